"""How many blocks each tier holds, from capacities in GB: the leader's answer to a worker's block size."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.errors import ConfigError
from kvdepot.storage.disk import OFFSET as DISK_OVERHEAD


@dataclass(frozen=True)
class TierSizes:
    """The leader's answer to a worker's bytes_per_block: capacities in whole chunks and blocks."""

    bytes_per_block: int
    blocks_per_chunk: int
    host_chunks: int
    disk_chunks: int
    num_host_blocks: int
    num_disk_blocks: int


def size_tiers(bytes_per_block: int, host_capacity_gb: float, disk_capacity_gb: float, blocks_per_chunk: int) -> TierSizes:
    """Blocks each tier holds. Tiers store whole chunks; a disk file adds its header block
    (``disk.OFFSET`` bytes), which the disk tier counts against its capacity."""
    if bytes_per_block <= 0 or blocks_per_chunk <= 0:
        raise ConfigError(f"bytes_per_block={bytes_per_block} and blocks_per_chunk={blocks_per_chunk} must be positive")
    if host_capacity_gb < 0 or disk_capacity_gb < 0:
        raise ConfigError(f"capacities must be >= 0 GB, got host={host_capacity_gb} disk={disk_capacity_gb}")
    chunk = bytes_per_block * blocks_per_chunk
    host = int(host_capacity_gb * 1e9) // chunk
    disk = int(disk_capacity_gb * 1e9) // (chunk + DISK_OVERHEAD)
    return TierSizes(bytes_per_block, blocks_per_chunk, host, disk, host * blocks_per_chunk, disk * blocks_per_chunk)
