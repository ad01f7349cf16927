"""The storage contract.

Two kinds of tier:

* the **host tier** (``host.HostTier``): a fixed arena of chunk slots in (pinned) host memory,
  the only tier blocks are copied to and from the engine's pool. Two-phase writes
  (``reserve`` -> copy -> ``commit``), leases on reads.
* **byte tiers** (disk, Redis, …) behind ``Tier``: whole chunks as self-describing byte
  objects, filled from and promoted into the host tier in the background.

``Tier`` primitives (keys are 16-byte ``ChunkKey``s; tiers never see tokens or engines):
    contains(key) -> bool        cheap presence check; False when unavailable
    get(key) -> bytes-like|None  verified payload (bytes or a read-only view), or None on a miss,
                                 a corrupt object or an outage
    get_into(key, out) -> int|None
                                 the same payload written into the writable buffer ``out`` (a host
                                 slot): its length, or None as for ``get`` (``out`` then undefined);
                                 ValueError if it is longer than ``out``. Every tier offers it: one
                                 that cannot read in place inherits ``CopyInto`` (``get``, then a copy)
    put(key, payload) -> bool    store (evicting as needed); False if it could not
    delete(key) -> bool
    stats() -> TierStats
Failures are values, never exceptions: a tier that is down answers misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvdepot.keys import ChunkKey
from kvdepot.storage.codec import Payload


@dataclass
class TierStats:
    """Counters every tier keeps; ``dataclasses.asdict`` makes them a stats row."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    dropped: int = 0  # writes that could not be placed (everything pinned, tier down, queue full)
    corrupt: int = 0  # objects that failed verification and were removed


class Tier(Protocol):
    """A byte tier below host memory."""

    name: str

    def contains(self, key: ChunkKey) -> bool: ...

    def get(self, key: ChunkKey) -> bytes | memoryview | None: ...

    def get_into(self, key: ChunkKey, out: Payload) -> int | None: ...

    def put(self, key: ChunkKey, payload: bytes) -> bool: ...

    def delete(self, key: ChunkKey) -> bool: ...

    def stats(self) -> TierStats: ...


class CopyInto:
    """``get_into`` for a tier that cannot read into a caller's buffer: ``get``, then one copy."""

    def get_into(self, key: ChunkKey, out: Payload) -> int | None:
        payload = self.get(key)  # type: ignore[attr-defined]
        if payload is None:
            return None
        target = memoryview(out).cast("B")
        if len(payload) > target.nbytes:
            raise ValueError(f"chunk {key.hex()}: payload of {len(payload)} bytes is longer than the {target.nbytes}-byte buffer")
        target[: len(payload)] = payload
        return len(payload)
