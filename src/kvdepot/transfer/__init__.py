"""Movers of whole KV blocks between an engine's pool and host chunk slots, by block id."""

from kvdepot.transfer.base import BlockMover, block_runs
from kvdepot.transfer.torch_mover import TorchBlockMover

__all__ = ["BlockMover", "TorchBlockMover", "block_runs"]
