"""Movers of whole KV blocks between an engine's pool and host chunk slots, by block id."""

from kvdepot.transfer.base import BlockMover, block_runs
from kvdepot.transfer.staged import StagedBlockMover
from kvdepot.transfer.torch_mover import TorchBlockMover

# Chosen by name (config key ``transfer_mover``, ``kvdepot bench transfer --mover``).
MOVERS: dict[str, type[BlockMover]] = {"runs": TorchBlockMover, "staged": StagedBlockMover}

__all__ = ["MOVERS", "BlockMover", "StagedBlockMover", "TorchBlockMover", "block_runs"]
