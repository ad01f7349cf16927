"""The host tier: an arena of fixed-size chunk slots in (pinned) host memory.

Each slot holds one chunk: ``blocks_per_chunk`` whole blocks, laid out as ``transfer.base``
describes. Slot memory is allocated in segments as the arena fills, so start-up does not pay
for pinning gigabytes the cache has not used yet; the arena never grows past its capacity.

Life of a slot: FREE -> ``reserve`` (WRITING: allocated, not readable) -> ``commit(ok)`` ->
READY (readable, in the eviction order) or FREE again. Reads happen under *leases*: a lease
pins slots so they cannot be evicted until ``release`` or, for leases given a timeout, until
the timeout passes (a lookup whose load never comes must not pin memory forever).
A full arena evicts the coldest unpinned READY slot; if every slot is pinned the write is
dropped and counted — a store never fails and never grows the arena.

Not thread-safe by itself: ``CacheEngine`` serializes calls with its lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvdepot.events.base import NULL_SINK, EventSink, Medium
from kvdepot.keys import ChunkKey
from kvdepot.storage.base import TierStats
from kvdepot.storage.policy import POLICIES

SEGMENT_BYTES = 128 << 20  # grow the arena 128 MiB (or one slot, if larger) at a time


@dataclass
class _Lease:
    keys: list[ChunkKey] = field(default_factory=list)
    deadline: float = math.inf


class HostTier:
    """Chunk slots with LRU eviction and leases. Sizes are in slots of ``slot_bytes``."""

    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        pin_memory: bool = False,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        events: EventSink = NULL_SINK,
    ) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.pin_memory = pin_memory
        self._per_segment = max(1, min(self.num_slots, SEGMENT_BYTES // slot_bytes))
        self._segments: list[torch.Tensor] = []
        self._slot_views: list[torch.Tensor] = []  # slot index -> its view (made once: ~5 us each)
        # False when the owner pins segments on a thread of its own: a store then never waits
        # for cudaHostAlloc (it evicts, or drops and counts, until memory arrives).
        self.grow_inline = True
        self._allocated = 0  # slots backed by memory so far
        self._free: list[int] = []
        self._slot_of: dict[ChunkKey, int] = {}
        self._ready: set[ChunkKey] = set()
        self._pins: dict[ChunkKey, int] = {}
        self._leases: dict[Hashable, _Lease] = {}
        self._policy = POLICIES[policy]()
        self._clock = clock
        self._events = events  # told of every chunk that becomes READY and every READY one dropped
        self._stats = TierStats(name=self.name, capacity_bytes=self.num_slots * slot_bytes)

    # ---- slots -------------------------------------------------------------------------
    def slot(self, key: ChunkKey) -> torch.Tensor:
        """The 1-D uint8 memory of ``key``'s slot. Only for a writer or a lease holder."""
        return self._slot_views[self._slot_of[key]]

    def next_segment_shape(self) -> tuple[int, int] | None:
        """Shape of the segment that would back the next slots, or None when the arena is full size."""
        if self._allocated >= self.num_slots:
            return None
        count = min(self._per_segment, self.num_slots - self._allocated)
        return (count, self.slot_bytes)  # only the last segment is short: divmod addressing holds

    def wants_segment(self) -> bool:
        """Free slots are running low and the arena may still grow: allocate ahead (off-thread)."""
        return len(self._free) < max(1, self._per_segment // 2) and self.next_segment_shape() is not None

    def allocate_segment(self) -> torch.Tensor | None:
        """Memory for the next segment. Pinning is slow (~GB/s), so callers may run this off-lock."""
        shape = self.next_segment_shape()
        return None if shape is None else torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin_memory)

    def add_segment(self, segment: torch.Tensor) -> bool:
        """Adopt memory from ``allocate_segment``; refused if it no longer fits the arena."""
        if self.next_segment_shape() != tuple(segment.shape):
            return False
        count = segment.shape[0]
        self._segments.append(segment)
        self._slot_views.extend(segment.unbind(0))
        self._free.extend(range(self._allocated + count - 1, self._allocated - 1, -1))
        self._allocated += count
        return True

    def _grow(self) -> bool:
        segment = self.allocate_segment()
        return segment is not None and self.add_segment(segment)

    def _evict_one(self) -> bool:
        """Free the coldest READY slot no lease pins. The caller expires timed-out leases first."""
        victim = None
        for key in self._policy.candidates():
            if key in self._ready and not self._pins.get(key):
                victim = key
                break
        if victim is None:
            return False
        self._drop(victim)
        self._events.removed(Medium.HOST, (victim,))
        self._stats.evictions += 1
        return True

    def _drop(self, key: ChunkKey) -> None:
        self._free.append(self._slot_of.pop(key))
        self._ready.discard(key)
        self._policy.remove(key)

    # ---- two-phase write ------------------------------------------------------------------
    def reserve(self, key: ChunkKey) -> torch.Tensor | None:
        """Allocate a WRITING slot for ``key``; None if present already or nothing is evictable."""
        return self.reserve_many([key])[0]

    def reserve_many(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        """``reserve`` each of ``keys`` in order, in one call: a store of many chunks.

        Timed-out leases are expired at the first eviction, so their pins do not keep a full arena
        full; once per call, not before every eviction, as an expiry scans every lease.
        """
        slots: list[torch.Tensor | None] = []
        expired = False
        for key in keys:
            if key in self._slot_of:
                slots.append(None)
                continue
            if not self._free and not (self.grow_inline and self._grow()):
                if not expired:
                    self.expire_leases()
                    expired = True
                if not self._evict_one():
                    self._stats.dropped += 1
                    slots.append(None)
                    continue
            self._slot_of[key] = self._free.pop()
            slots.append(self.slot(key))
        return slots

    def commit(self, key: ChunkKey, ok: bool) -> None:
        """Finish a write: READY on success, FREE again on failure."""
        if key not in self._slot_of or key in self._ready:
            return
        if ok:
            self._ready.add(key)
            self._policy.touch(key)
            self._stats.puts += 1
            self._events.stored(Medium.HOST, (key,))
        else:
            self._drop(key)

    # ---- reads under leases --------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey], lease: Hashable | None = None, timeout_s: float = math.inf) -> int:
        """Count the READY prefix of ``keys``; pin it under ``lease`` (replacing its old pins)."""
        self.expire_leases()
        count = 0
        for key in keys:
            if key not in self._ready:
                break
            count += 1
        self._stats.hits += count
        self._stats.misses += 1 if count < len(keys) else 0
        for key in keys[:count]:
            self._policy.touch(key)
        if lease is not None:
            self.release(lease)
            if count:
                self.pin(lease, keys[:count], timeout_s)
        return count

    def pin(self, lease: Hashable, keys: Sequence[ChunkKey], timeout_s: float = math.inf) -> None:
        """Add READY or WRITING ``keys`` to ``lease`` so they cannot be evicted."""
        held = self._leases.setdefault(lease, _Lease())
        held.deadline = self._clock() + timeout_s
        for key in keys:
            if key in self._slot_of:
                held.keys.append(key)
                self._pins[key] = self._pins.get(key, 0) + 1

    def release(self, lease: Hashable) -> None:
        held = self._leases.pop(lease, None)
        if held is None:
            return
        for key in held.keys:
            left = self._pins[key] - 1
            if left:
                self._pins[key] = left
            else:
                del self._pins[key]

    def expire_leases(self) -> int:
        now = self._clock()
        expired = [lease for lease, held in self._leases.items() if held.deadline <= now]
        for lease in expired:
            self.release(lease)
        return len(expired)

    def holds(self, lease: Hashable, key: ChunkKey) -> bool:
        held = self._leases.get(lease)
        return held is not None and key in held.keys

    # ---- housekeeping --------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._ready

    def delete(self, key: ChunkKey) -> bool:
        if key not in self._ready or self._pins.get(key):
            return False
        self._drop(key)
        self._events.removed(Medium.HOST, (key,))
        return True

    @property
    def allocated_slots(self) -> int:
        """Slots backed by memory so far (the arena grows in segments up to ``num_slots``)."""
        return self._allocated

    @property
    def live_leases(self) -> int:
        return len(self._leases)

    @property
    def pinned_chunks(self) -> int:
        return len(self._pins)

    def stats(self) -> TierStats:
        self._stats.chunks = len(self._ready)
        self._stats.used_bytes = len(self._slot_of) * self.slot_bytes
        return self._stats
