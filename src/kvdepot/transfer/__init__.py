"""Movers of whole KV blocks between an engine's pool and host chunk slots, by block id."""

from kvdepot.transfer.base import BlockMover, block_runs
from kvdepot.transfer.batch import BatchBlockMover
from kvdepot.transfer.staged import StagedBlockMover
from kvdepot.transfer.torch_mover import TorchBlockMover

# Chosen by name (config key ``transfer_mover``, ``kvdepot bench transfer --mover``).
MOVERS: dict[str, type[BlockMover]] = {"batch": BatchBlockMover, "runs": TorchBlockMover, "staged": StagedBlockMover}

__all__ = ["MOVERS", "BatchBlockMover", "BlockMover", "StagedBlockMover", "TorchBlockMover", "block_runs"]
