"""``kvdepot.storage.pinner.ArenaPinner`` on arenas sharing one ``HostBudget``: pinned ahead up to
their share, grown beyond it on demand, given back to an arena starving below its own; and
promotions that wait for the memory a pinner is still adding.

The arenas are unpinned (CPU) memory with ``ahead=True``: the thread then runs exactly as on a
CUDA host, where the server pins each shard's arena ahead of use (the H200 failure this covers:
the first model group pinned the whole budget, the second stored nothing).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from fakes import FakeClock
from kvdepot.storage import host as host_module
from kvdepot.storage.budget import HostBudget
from kvdepot.storage.host import HostTier
from kvdepot.storage.pinner import ArenaPinner
from kvdepot.storage.promotions import Promotions

pytestmark = pytest.mark.timeout(60)

SLOT = 64
TOTAL = 64 * SLOT  # segments of 1/16: 4 slots


def key(tag: int, i: int) -> bytes:
    return tag.to_bytes(8, "little") + i.to_bytes(8, "little")


class Arena:
    """A host tier, its owner's lock and its pinner (pinning ahead unless ``ahead`` is False)."""

    def __init__(self, slots: int, budget: HostBudget | None = None, *, ahead: bool = True, host: HostTier | None = None) -> None:
        self.host = host or HostTier(slots * SLOT, SLOT, clock=FakeClock())
        if budget is not None:
            self.host.share_budget(budget)
        self.lock = threading.RLock()
        self.pinner = ArenaPinner(self.host, self.lock, ahead=ahead)

    def start(self, wait: bool = True) -> Arena:
        with self.lock:
            self.pinner.start_locked()
        if wait:
            self.pinner.wait(10)
        return self

    def store(self, tag: int, n: int) -> int:
        """Store ``n`` chunks (reserve, write, commit) as the engine does; how many found a slot."""
        with self.lock:
            slots = self.host.reserve_many([key(tag, i) for i in range(n)])
            for i, slot in enumerate(slots):
                if slot is not None:
                    slot.fill_(tag)
                    self.host.commit(key(tag, i), True)
        return sum(s is not None for s in slots)

    @property
    def slots(self) -> int:
        return self.host.allocated_slots

    def close(self) -> None:
        if isinstance(self.host, GatedArena):
            self.host.gate.release(100)  # a pinner waiting at the gate stops
        self.pinner.close()
        self.host.close()


@pytest.fixture
def arenas():
    made: list[Arena] = []
    yield made
    for arena in made:
        arena.close()


@pytest.mark.parametrize("one_first", [True, False], ids=["one-copy-group-first", "per-rank-group-first"])
def test_arenas_pinned_ahead_share_the_budget_whatever_order_they_register_in(arenas, one_first):
    """``kvdepot bench tp``'s server: a one-copy group (one shard, the whole capacity) and a
    per-rank group (two shards of half); every shard stores its chunks, in either order."""
    budget = HostBudget(TOTAL)
    one = Arena(64, budget)
    ranks = [Arena(32, budget), Arena(32, budget)]
    arenas.extend([one, *ranks])
    for arena in ([one, *ranks] if one_first else [*ranks, one]):
        arena.start()
        assert budget.used <= TOTAL
    assert [r.slots for r in ranks] == [16, 16]  # a quarter each: the group's half, split
    assert 28 <= one.slots <= 32  # its half, to within a segment
    assert [r.store(i, 16) for i, r in enumerate(ranks)] == [16, 16]
    assert one.store(9, 28) == 28
    assert budget.used == sum(a.slots for a in arenas) * SLOT <= TOTAL


def test_a_lone_arena_pins_the_whole_budget_ahead(arenas):
    """The reason pinning runs ahead: a fresh single-model server takes a first big store whole."""
    budget = HostBudget(TOTAL)
    arenas.append(alone := Arena(64, budget).start())
    assert alone.slots == 64 and alone.pinner.pending_slots == 0
    assert alone.store(1, 64) == 64


def test_beyond_its_share_an_arena_grows_on_demand_and_gives_it_back_to_the_owner(arenas):
    budget = HostBudget(TOTAL)
    pinned = Arena(64, budget)
    inline = Arena(64, budget, ahead=False)  # grows as it stores (a CPU arena)
    arenas.extend([pinned.start(), inline.start()])
    assert (pinned.slots, inline.slots) == (32, 0)  # its share ahead, no more
    assert pinned.store(1, 32) == 32
    assert pinned.store(2, 1) == 1  # no free slot: its coldest chunk goes, and the pinner is told
    assert pinned.pinner.wait_for_room(10)  # the other half is free and nobody starves: it grows
    grown = pinned.slots
    assert grown > 32
    assert inline.store(3, 32) == 32  # its share, taken back: the grown segments' chunks evicted
    # The pinner may have had a segment in flight (taken from the budget, pinned off-lock) when the
    # reclaim ran: the reclaim counts it as held, so the arena's slots reach its share once it lands.
    pinned.pinner.wait(10)
    assert inline.slots == 32 and pinned.slots == 32 and budget.used == TOTAL
    with pinned.lock:
        assert pinned.host.stats().chunks <= 32


def test_a_reclaim_never_takes_a_segment_a_lease_pins(arenas):
    budget = HostBudget(TOTAL)
    first = Arena(64, budget, ahead=False)
    arenas.append(first.start())
    assert first.store(1, 64) == 64
    with first.lock:
        first.host.lookup([key(1, i) for i in range(64)], lease="request")  # every chunk pinned
    second = Arena(64, budget, ahead=False)
    arenas.append(second.start())
    assert second.store(2, 4) == 0  # nothing can be given back while the lease holds it all
    with first.lock:
        first.host.release("request")
    assert second.store(2, 4) == 4 and first.slots >= 28
    with first.lock:
        assert first.host.lookup([key(1, i) for i in range(64)]) < 64  # the given-back chunks are gone


class GatedArena(HostTier):
    """An arena whose memory arrives only when the test opens the gate (one segment per permit):
    the pinner thread's cudaHostAlloc, slowed at will."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.gate = threading.Semaphore(1)  # the first segment, pinned at registration

    def allocate_segment(self, max_slots: int | None = None) -> torch.Tensor | None:
        self.gate.acquire()
        return super().allocate_segment(max_slots)


class FakeLower:
    """Lower tiers that hold every chunk and read it into the reserved slot on a thread."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)

    def note_hits(self, keys: list[bytes]) -> None:
        pass

    def find(self, keys: list[bytes]) -> int:
        return len(keys)

    def promote(self, keys: list[bytes], reserve) -> Future[int]:  # noqa: ANN001
        def run() -> int:
            for count, k in enumerate(keys):
                target = reserve(k)
                if target is None:
                    return count
                view, done = target
                if view is not None:
                    view[:] = bytes([k[0]]) * SLOT
                done(True)
            return len(keys)

        return self.pool.submit(run)


def test_a_promotion_waits_for_the_memory_the_pinner_is_still_adding(arenas, monkeypatch):
    """A fresh engine's first request: many lower-tier chunks to read, an arena still being pinned
    (H200: 32 chunks of 32 MiB, 2304 of 8192 tokens loaded). The promotion waits for each segment,
    the probe does not wait at all."""
    monkeypatch.setattr(host_module, "SEGMENT_BYTES", 4 * SLOT)
    host = GatedArena(16 * SLOT, SLOT, clock=FakeClock())
    arena = Arena(16, host=host)
    arenas.append(arena.start(wait=False))  # first segment only: 4 slots
    lower = FakeLower()
    promotions = Promotions(host, lower, arena.lock, lease_timeout_s=30, room=arena.pinner.wait_for_room)
    keys = [key(7, i) for i in range(12)]
    assert promotions.find(keys, 0, "lease") == 12  # answers at once, reads in the background
    assert not promotions.done("lease")
    for _ in range(2):  # two more segments of 4
        host.gate.release()
    promotions.wait_all(timeout=10)
    assert promotions.promoted("lease") == 12 and host.allocated_slots == 12
    with arena.lock:
        assert host.lookup(keys) == 12 and host.stats().dropped == 0
    promotions.release("lease")
    lower.pool.shutdown()


def test_a_promotion_into_an_arena_full_of_pinned_chunks_stops_at_once(arenas):
    host = GatedArena(8 * SLOT, SLOT, clock=FakeClock())
    host.gate = threading.Semaphore(100)
    arena = Arena(8, host=host)
    arenas.append(arena.start())
    lower = FakeLower()
    promotions = Promotions(host, lower, arena.lock, lease_timeout_s=30, room=arena.pinner.wait_for_room)
    assert promotions.find([key(1, i) for i in range(8)], 0, "a") == 8
    promotions.wait_all(timeout=10)
    assert promotions.promoted("a") == 8  # every slot pinned under "a"
    promotions.find([key(2, 0)], 0, "b")
    promotions.wait_all(timeout=10)
    assert promotions.promoted("b") == 0  # at once, not after the 30 s lease timeout: nothing is coming
    assert host.stats().dropped == 1
    for lease in ("a", "b"):
        promotions.release(lease)
    lower.pool.shutdown()
