"""The host tier: an arena of fixed-size chunk slots in (pinned) host memory.

Each slot holds one chunk: ``blocks_per_chunk`` whole blocks, laid out as ``transfer.base``
describes. Slot memory is allocated in segments as the arena fills (or ahead, by its owner's
pinner), so start-up does not pay for pinning gigabytes the cache has not used yet; the arena
never grows past its capacity. Arenas that share a ``Budget`` (the server's models) take their
segments from it, and an arena above its fair share gives whole segments back (``give_back``,
their chunks evicted) to one starving below its own.

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
from kvdepot.storage.budget import Budget
from kvdepot.storage.policy import POLICIES

SEGMENT_BYTES = 128 << 20  # grow the arena 128 MiB (or one slot, if larger) at a time
PAGE = 4096


def page_aligned(count: int, slot_bytes: int) -> torch.Tensor:
    """``count`` slots of plain memory starting on a page: torch's CPU allocator aligns to 64
    bytes only. With a slot size that is a multiple of 4 KiB every slot is page-aligned, so the
    disk tier writes and reads slots in place (O_DIRECT) rather than through its bounce buffer,
    a memcpy of each chunk each way, on CPU-only engines too (vLLM's CPU build)."""
    raw = torch.empty(count * slot_bytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + count * slot_bytes].view(count, slot_bytes)


_GONE = torch.empty(0, dtype=torch.uint8)  # the view of a slot whose segment was given back


@dataclass
class _Segment:
    first: int  # index of its first slot
    memory: torch.Tensor  # [slots, slot_bytes]


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
        self._segments: list[_Segment] = []
        self._slot_views: list[torch.Tensor] = []  # slot index -> its view (made once: ~5 us each)
        self._slot_spans: list[tuple[int, int] | None] = []  # slot index -> ``span`` (made with the view)
        # False when the owner pins segments on a thread of its own: a store then never waits
        # for cudaHostAlloc (it evicts, or drops and counts, until memory arrives), and calls
        # ``on_short`` when it found no free slot in an arena that may still grow.
        self.grow_inline = True
        self.on_short: Callable[[], None] = _nothing
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
        self._budget: Budget | None = None

    def share_budget(self, budget: Budget | None) -> None:
        """Take every segment from ``budget`` too (before any is allocated), as one of the arenas
        that share it fairly, weighted by capacity (``storage/budget.py``). Segments shrink to
        1/16 of the budget at most, so that shares can be met to within one and the first arena
        to grow does not take the whole budget for a few chunks."""
        if self._allocated:
            raise ValueError("share_budget: the arena has memory already")
        self._budget = budget
        if budget is not None:
            self._per_segment = max(1, min(self._per_segment, budget.total // 16 // self.slot_bytes))
            budget.join(self, self.num_slots * self.slot_bytes)

    def join_budget(self, reclaim: Callable[[int], int], wake: Callable[[], None]) -> None:
        """The owner's callbacks for the budget: ``reclaim(n)`` gives back >= n bytes if it can
        (``give_back`` under the owner's lock, never waiting for it), ``wake`` says memory came free."""
        if self._budget is not None:
            self._budget.join(self, self.num_slots * self.slot_bytes, reclaim, wake)

    def close(self) -> None:
        """Drop the arena's memory and give it back to the budget; the tier holds nothing after
        (its owner has finished every copy). Idempotent."""
        if self._budget is not None:
            self._budget.leave(self)
        self._segments, self._slot_views, self._slot_spans, self._free = [], [], [], []
        self._slot_of, self._ready, self._pins, self._leases = {}, set(), {}, {}
        self._allocated = self.num_slots = 0

    # ---- slots -------------------------------------------------------------------------
    def slot(self, key: ChunkKey) -> torch.Tensor:
        """The 1-D uint8 memory of ``key``'s slot. Only for a writer or a lease holder."""
        return self._slot_views[self._slot_of[key]]

    def span(self, key: ChunkKey) -> tuple[int, int]:
        """``key``'s slot address and its allocation's (``transfer.base.ChunkCopy.span``), noted
        when the slot was made: asking torch (``data_ptr()``) costs up to ~8 us a call as an
        operation starts with the caches cold, two per chunk (issue 19). Only for a writer or a lease holder."""
        span = self._slot_spans[self._slot_of[key]]
        assert span is not None  # a given-back segment's slots hold no key
        return span

    @property
    def segments(self) -> tuple[torch.Tensor, ...]:
        """The arena's allocations, oldest first (for diagnostics: where their pages lie)."""
        return tuple(s.memory for s in self._segments)

    def target_slots(self) -> int:
        """Slots worth allocating ahead of use: the arena's share of the budget, else all of it."""
        if self._budget is None:
            return self.num_slots
        return min(self.num_slots, self._budget.share(self) // self.slot_bytes)

    def next_segment_shape(self) -> tuple[int, int] | None:
        """Shape of the segment that would back the next slots, or None when the arena is full size."""
        if self._allocated >= self.num_slots:
            return None
        count = min(self._per_segment, self.num_slots - self._allocated)
        return (count, self.slot_bytes)  # slots are reached through their views: segments may differ in size

    def wants_segment(self) -> bool:
        """Free slots are running low and the arena may still grow: allocate ahead (off-thread)."""
        return len(self._free) < max(1, self._per_segment // 2) and self.next_segment_shape() is not None

    def allocate_segment(self, max_slots: int | None = None) -> torch.Tensor | None:
        """Memory for the next segment (at most ``max_slots``), taken from the budget, for which
        the arena reclaims memory from arenas above their share when it starves below its own.
        Pinning is slow (~GB/s), so callers may run this off-lock."""
        shape = self.next_segment_shape()
        if shape is None:
            return None
        count = min(shape[0], max_slots) if max_slots is not None else shape[0]
        if count <= 0:
            return None
        if self._budget is not None:
            want = count * self.slot_bytes
            taken = self._budget.take(self, want, self.slot_bytes)
            if not taken and self._budget.reclaim_for(self):
                taken = self._budget.take(self, want, self.slot_bytes)
            count = taken // self.slot_bytes
            if not count:
                return None
        try:
            if self.pin_memory:  # cudaHostAlloc's memory is page-aligned already
                return torch.empty((count, self.slot_bytes), dtype=torch.uint8, pin_memory=True)
            return page_aligned(count, self.slot_bytes)
        except BaseException:
            if self._budget is not None:
                self._budget.give(self, count * self.slot_bytes)
            raise

    def add_segment(self, segment: torch.Tensor) -> bool:
        """Adopt memory from ``allocate_segment``; refused if it no longer fits the arena."""
        want = self.next_segment_shape()
        count = segment.shape[0]
        if want is None or segment.shape[1] != self.slot_bytes or count > want[0]:
            if self._budget is not None:
                self._budget.give(self, count * self.slot_bytes)
            return False
        first = len(self._slot_views)  # indices of given-back segments are never reused
        self._segments.append(_Segment(first, segment))
        self._slot_views.extend(segment.unbind(0))
        at, alloc, size = segment.data_ptr(), segment.untyped_storage().data_ptr(), segment.stride(0) * segment.element_size()
        self._slot_spans.extend((at + n * size, alloc) for n in range(count))
        self._free.extend(range(first + count - 1, first - 1, -1))
        self._allocated += count
        return True

    def give_back(self, nbytes: int) -> int:
        """Free whole segments, >= ``nbytes`` if it can, for an arena that starves below its share
        of the budget; the bytes given back. The arena never ends a whole segment below its own
        share. Only a segment no lease pins and nobody writes goes, its chunks evicted; the
        emptiest first."""
        if self._budget is None:
            return 0
        room = self._budget.held(self) - self._budget.share(self) + self._per_segment * self.slot_bytes - 1
        self.expire_leases()
        owner = {slot: key for key, slot in self._slot_of.items()}
        movable = []
        for seg in self._segments:
            keys = [owner[i] for i in range(seg.first, seg.first + seg.memory.shape[0]) if i in owner]
            if all(k in self._ready and not self._pins.get(k) for k in keys):
                movable.append((len(keys), -seg.first, seg, keys))
        given = 0
        for _, _, seg, keys in sorted(movable, key=lambda m: m[:2]):
            size = seg.memory.numel()
            if given >= nbytes:
                break
            if given + size > room:
                continue
            for key in keys:
                self._drop(key)
            if keys:
                self._events.removed(Medium.HOST, tuple(keys))
                self._stats.evictions += len(keys)
            gone = range(seg.first, seg.first + seg.memory.shape[0])
            self._free = [i for i in self._free if i not in gone]
            self._slot_views[gone.start : gone.stop] = [_GONE] * len(gone)
            self._slot_spans[gone.start : gone.stop] = [None] * len(gone)
            self._segments.remove(seg)
            self._allocated -= len(gone)
            self._budget.give(self, size)
            given += size
        return given

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
    def reserve(self, key: ChunkKey, *, count_drop: bool = True) -> torch.Tensor | None:
        """Allocate a WRITING slot for ``key``; None if present already or nothing is evictable
        (counted as dropped unless the caller will try again: ``count_drop=False``)."""
        return self.reserve_many([key], count_drop=count_drop)[0]

    def reserve_many(self, keys: Sequence[ChunkKey], *, count_drop: bool = True) -> list[torch.Tensor | None]:
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
                if not self.grow_inline and self.next_segment_shape() is not None:
                    self.on_short()  # the pinner may add memory (off-thread; this write goes on)
                if not expired:
                    self.expire_leases()
                    expired = True
                if not self._evict_one():
                    self._stats.dropped += count_drop
                    slots.append(None)
                    continue
            self._slot_of[key] = self._free.pop()
            # Ranked now, not at commit: a WRITING slot is never a victim (``_evict_one`` takes
            # READY ones), and the commit runs after the store's last copy, on its waiter's clock.
            self._policy.touch(key)
            slots.append(self.slot(key))
        return slots

    def commit(self, key: ChunkKey, ok: bool) -> None:
        """Finish a write: READY on success, FREE again on failure."""
        self.commit_many((key,), ok)

    def commit_many(self, keys: Sequence[ChunkKey], ok: bool) -> None:
        """``commit`` each of ``keys``, with one event for those made READY: a store's chunks
        commit once its copies have landed, in the time between its last copy and its waiter's
        return (issue 19: host time there counts against a small store as much as before its first)."""
        done = []
        for key in keys:
            if key not in self._slot_of or key in self._ready:
                continue
            if ok:
                self._ready.add(key)
                done.append(key)
            else:
                self._drop(key)
        if done:
            self._stats.puts += len(done)
            self._events.stored(Medium.HOST, done)

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

    def present(self, key: ChunkKey) -> bool:
        """READY, or WRITING (reserved, not committed yet)."""
        return key in self._slot_of

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


def _nothing() -> None:
    pass
