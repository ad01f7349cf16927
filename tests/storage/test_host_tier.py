"""``kvdepot.storage.host.HostTier`` and ``storage.policy``: slots, LRU, leases, byte bounds.

Scripted scenarios with a fake clock (leases expire only when the test moves time), then a
hypothesis state machine that interleaves every operation and checks the invariants after
each step: the byte bound, that a present key's slot holds exactly what was written for it,
and that a live lease's chunks are never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fakes import FakeClock
from kvdepot.storage import host as host_module
from kvdepot.storage.budget import HostBudget
from kvdepot.storage.host import HostTier
from kvdepot.storage.policy import POLICIES, LRUPolicy

SLOT = 8


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(tier: HostTier, k: bytes, fill: int) -> torch.Tensor | None:
    """Reserve, write ``fill`` into every byte and commit; the slot, or None if dropped."""
    slot = tier.reserve(k)
    if slot is not None:
        slot.fill_(fill)
        tier.commit(k, True)
    return slot


def verify_contents(tier: HostTier, expected: dict[bytes, int]) -> None:
    for k, fill in expected.items():
        assert tier.contains(k), k
        assert torch.equal(tier.slot(k), torch.full((tier.slot_bytes,), fill, dtype=torch.uint8)), k


def verify_idle(tier: HostTier) -> None:
    assert (tier.live_leases, tier.pinned_chunks) == (0, 0)


# ---- scripted scenarios ----------------------------------------------------------------------


def test_two_phase_write():
    tier = HostTier(3 * SLOT, SLOT, clock=FakeClock())
    slot = tier.reserve(key(1))
    assert slot is not None and slot.dtype == torch.uint8 and slot.shape == (SLOT,)
    assert tier.reserve(key(1)) is None  # already WRITING
    assert not tier.contains(key(1)) and tier.lookup([key(1)]) == 0  # WRITING is not readable
    slot.fill_(7)
    tier.commit(key(1), True)
    verify_contents(tier, {key(1): 7})
    assert tier.reserve(key(1)) is None  # already READY
    tier.commit(key(1), True)  # a second commit changes nothing
    tier.commit(key(9), True)  # nor does committing a key never reserved
    stats = tier.stats()
    assert (stats.puts, stats.chunks, stats.used_bytes, stats.capacity_bytes) == (1, 1, SLOT, 3 * SLOT)


class _Recorder:
    """An event sink that keeps what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def stored(self, medium, keys) -> None:
        self.calls.append(("stored", list(keys)))

    def removed(self, medium, keys) -> None:
        self.calls.append(("removed", list(keys)))

    def cleared(self) -> None:
        self.calls.append(("cleared", []))


def test_commit_many_commits_each_and_tells_the_ones_made_ready_in_one_event():
    """A store's chunks commit together after its last copy: ``commit`` of each, in one event."""
    sink = _Recorder()
    tier = HostTier(4 * SLOT, SLOT, clock=FakeClock(), events=sink)
    put(tier, key(1), 1)
    for i in (2, 3):
        tier.reserve(key(i)).fill_(i)
    sink.calls.clear()
    tier.commit_many([key(1), key(2), key(9), key(3)], True)  # 1 READY already, 9 never reserved
    assert sink.calls == [("stored", [key(2), key(3)])]
    verify_contents(tier, {key(1): 1, key(2): 2, key(3): 3})
    assert tier.stats().puts == 3
    tier.reserve(key(4))
    tier.commit_many([key(4), key(2)], False)  # a failed write frees its slot; a READY chunk stays
    assert not tier.present(key(4)) and tier.contains(key(2))
    assert sink.calls == [("stored", [key(2), key(3)])]  # nothing was made READY or dropped from READY


def test_failed_write_frees_the_slot():
    tier = HostTier(1 * SLOT, SLOT, clock=FakeClock())
    assert tier.reserve(key(1)) is not None
    assert tier.stats().used_bytes == SLOT
    tier.commit(key(1), False)
    assert not tier.contains(key(1)) and tier.stats().used_bytes == 0 and tier.stats().puts == 0
    assert put(tier, key(2), 3) is not None  # the one slot is free again, no eviction needed
    assert tier.stats().evictions == 0


def test_lru_evicts_the_coldest_and_keeps_the_rest_intact():
    tier = HostTier(3 * SLOT, SLOT, clock=FakeClock())
    for i in (1, 2, 3):
        put(tier, key(i), i)
    assert tier.lookup([key(1)]) == 1  # 1 is now the hottest, 2 the coldest
    put(tier, key(4), 4)
    assert not tier.contains(key(2)) and tier.lookup([key(2)]) == 0
    verify_contents(tier, {key(1): 1, key(3): 3, key(4): 4})
    put(tier, key(5), 5)
    assert not tier.contains(key(3))
    verify_contents(tier, {key(1): 1, key(4): 4, key(5): 5})
    assert tier.stats().evictions == 2 and tier.stats().chunks == 3


def test_writing_and_pinned_slots_are_never_evicted_and_a_full_arena_drops():
    tier = HostTier(2 * SLOT, SLOT, clock=FakeClock())
    assert tier.reserve(key(1)) is not None  # WRITING
    put(tier, key(2), 2)
    assert tier.lookup([key(2)], lease="r") == 1  # pinned
    assert tier.reserve(key(3)) is None  # nothing evictable: dropped, not grown
    stats = tier.stats()
    assert (stats.dropped, stats.evictions, stats.used_bytes) == (1, 0, 2 * SLOT)
    tier.release("r")
    assert put(tier, key(3), 3) is not None  # now 2 is evictable
    assert not tier.contains(key(2))
    tier.commit(key(1), False)
    verify_idle(tier)


def test_lookup_counts_the_ready_prefix_and_pins_only_it():
    tier = HostTier(4 * SLOT, SLOT, clock=FakeClock())
    for i in (1, 3):
        put(tier, key(i), i)
    assert tier.lookup([key(1), key(2), key(3)], lease="a") == 1
    assert tier.holds("a", key(1)) and not tier.holds("a", key(3))
    assert tier.pinned_chunks == 1
    stats = tier.stats()
    assert (stats.hits, stats.misses) == (1, 1)
    assert tier.lookup([key(3)], lease="a") == 1  # a new lookup replaces the lease's pins
    assert not tier.holds("a", key(1)) and tier.pinned_chunks == 1
    assert tier.lookup([key(2)], lease="a") == 0  # a miss leaves the lease holding nothing
    verify_idle(tier)


def test_leases_stack_and_delete_respects_pins():
    tier = HostTier(2 * SLOT, SLOT, clock=FakeClock())
    put(tier, key(1), 1)
    tier.lookup([key(1)], lease="a")
    tier.lookup([key(1)], lease="b")
    assert not tier.delete(key(1))
    tier.release("a")
    assert tier.pinned_chunks == 1 and not tier.delete(key(1))
    tier.release("b")
    tier.release("b")  # releasing twice is harmless
    assert tier.delete(key(1)) and not tier.contains(key(1)) and not tier.delete(key(1))
    assert tier.reserve(key(2)) is not None and not tier.delete(key(2))  # WRITING: not deletable
    verify_idle(tier)


def test_lease_timeout_with_a_fake_clock():
    clock = FakeClock()
    tier = HostTier(1 * SLOT, SLOT, clock=clock)
    put(tier, key(1), 1)
    assert tier.lookup([key(1)], lease="slow", timeout_s=5.0) == 1
    clock.now += 4.999
    assert tier.expire_leases() == 0 and tier.pinned_chunks == 1
    assert tier.reserve(key(2)) is None  # still pinned: dropped
    clock.now += 0.001
    assert tier.expire_leases() == 1
    verify_idle(tier)
    assert tier.lookup([key(1)], lease="slow2", timeout_s=1.0) == 1
    clock.now += 2.0
    # No explicit expiry call: a write that needs room must not be blocked by a dead lease.
    assert put(tier, key(2), 2) is not None
    assert not tier.contains(key(1))
    verify_idle(tier)


def test_reserve_many_reserves_in_order_and_re_reserves_a_chunk_it_evicted():
    tier = HostTier(2 * SLOT, SLOT, clock=FakeClock())
    put(tier, key(2), 2)  # the coldest
    put(tier, key(3), 3)
    # key(1) evicts key(2); key(2) is then absent, so it is reserved again (evicting key(3));
    # the repeated key(1) is WRITING already.
    slots = tier.reserve_many([key(1), key(2), key(1)])
    assert [s is not None for s in slots] == [True, True, False]
    assert tier.stats().evictions == 2 and not tier.contains(key(3))
    for k in (key(1), key(2)):
        tier.commit(k, False)
    verify_idle(tier)


def test_reserve_many_expires_a_timed_out_lease_before_evicting():
    clock = FakeClock()
    tier = HostTier(2 * SLOT, SLOT, clock=clock)
    put(tier, key(1), 1)
    put(tier, key(2), 2)
    assert tier.lookup([key(1), key(2)], lease="slow", timeout_s=1.0) == 2
    assert tier.reserve_many([key(3), key(4)]) == [None, None]  # all pinned: both dropped
    clock.now += 2.0
    assert all(s is not None for s in tier.reserve_many([key(3), key(4)]))
    assert tier.stats().dropped == 2 and tier.stats().evictions == 2
    verify_idle(tier)


def _index(tier: HostTier, slot) -> int | None:
    """Which of ``tier``'s slots ``slot`` is (its place in the arena, whatever the memory's address)."""
    return None if slot is None else [v.data_ptr() for v in tier._slot_views].index(slot.data_ptr())


@settings(max_examples=100, deadline=None)
@given(
    slots=st.integers(1, 4),
    setup=st.lists(st.tuples(st.sampled_from(["put", "pin", "reserve", "advance"]), st.integers(0, 7)), max_size=12),
    batch=st.lists(st.integers(0, 7), max_size=6),
)
def test_reserve_many_is_reserve_called_in_order(slots, setup, batch):
    """Same slots, same evictions, same drops as one ``reserve`` per key, whatever came before."""
    tiers = []
    for _ in range(2):
        clock = FakeClock()
        tier = HostTier(slots * SLOT, SLOT, clock=clock)
        for op, i in setup:
            if op == "put":
                put(tier, key(i), i)
            elif op == "pin":
                tier.lookup([key(i)], lease=i, timeout_s=1.0 + i % 2 * 10)
            elif op == "reserve":
                tier.reserve(key(i))
            else:
                clock.now += 2.0
        tiers.append(tier)
    many = tiers[0].reserve_many([key(i) for i in batch])
    one = [tiers[1].reserve(key(i)) for i in batch]
    assert [_index(tiers[0], s) for s in many] == [_index(tiers[1], s) for s in one]
    a, b = (t.stats() for t in tiers)
    assert (a.evictions, a.dropped, a.used_bytes, a.chunks) == (b.evictions, b.dropped, b.used_bytes, b.chunks)
    assert [tiers[0].contains(key(i)) for i in range(8)] == [tiers[1].contains(key(i)) for i in range(8)]
    assert (tiers[0].live_leases, tiers[0].pinned_chunks) == (tiers[1].live_leases, tiers[1].pinned_chunks)


def test_capacity_below_one_slot_holds_nothing():
    tier = HostTier(SLOT - 1, SLOT, clock=FakeClock())
    assert tier.num_slots == 0 and tier.reserve(key(1)) is None
    assert tier.stats().dropped == 1 and tier.stats().capacity_bytes == 0
    with pytest.raises(ValueError, match="slot_bytes"):
        HostTier(SLOT, 0)


def test_arena_grows_in_segments_up_to_capacity(monkeypatch):
    monkeypatch.setattr(host_module, "SEGMENT_BYTES", 3 * SLOT)  # 3 slots a segment: 3 + 3 + 1
    tier = HostTier(7 * SLOT + 5, SLOT, clock=FakeClock())
    assert tier.num_slots == 7
    assert tier.allocated_slots == 0  # nothing backed until the first write
    slots = {i: put(tier, key(i), i) for i in range(7)}
    assert tier.allocated_slots == 7
    verify_contents(tier, {key(i): i for i in range(7)})
    spans = sorted((s.data_ptr(), s.data_ptr() + SLOT) for s in slots.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert put(tier, key(7), 7) is not None and tier.stats().evictions == 1  # full: evict, never grow
    assert tier.stats().used_bytes == 7 * SLOT <= tier.stats().capacity_bytes


def test_a_slot_s_span_is_where_torch_says_it_is_as_segments_come_and_go():
    """``span`` stands for torch's answer in every copy list the movers make: a wrong one would
    copy to or from the wrong bytes. Checked over growth, a reclaim that gives segments back to
    another arena, and the growth after it (new slot indices)."""
    budget = HostBudget(16 * SLOT)
    tier = HostTier(16 * SLOT, SLOT, clock=FakeClock())
    tier.share_budget(budget)  # segments of one slot: 1/16 of the budget

    def check() -> None:
        held = [k for k in map(key, range(40)) if tier.contains(k)]
        assert held
        for k in held:
            slot = tier.slot(k)
            assert tier.span(k) == (slot.data_ptr(), slot.untyped_storage().data_ptr())

    for i in range(16):
        put(tier, key(i), i)
    check()
    other = HostTier(16 * SLOT, SLOT, clock=FakeClock())
    other.share_budget(budget)  # shares of 8 slots each: 8 may go
    assert tier.give_back(4 * SLOT) == 4 * SLOT and tier.allocated_slots == 12
    check()
    budget.leave(other)
    for i in range(16, 40):
        put(tier, key(i), i)
    assert tier.allocated_slots == 16
    check()
    tier.close()


def test_lru_policy_order_and_registry():
    policy = POLICIES["lru"]()
    assert isinstance(policy, LRUPolicy)
    for i in (1, 2, 3):
        policy.touch(key(i))
    policy.touch(key(1))
    assert list(policy.candidates()) == [key(2), key(3), key(1)]
    policy.remove(key(3))
    policy.remove(key(9))  # unknown: no error
    assert list(policy.candidates()) == [key(2), key(1)] and len(policy) == 2


# ---- properties --------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(slots=st.integers(1, 4), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40))
def test_without_pins_the_present_set_is_exactly_lru(slots, ops):
    """Inserts and hits against a reference LRU: the tier holds exactly what the reference holds."""
    tier = HostTier(slots * SLOT, SLOT, clock=FakeClock())
    ref: OrderedDict[bytes, int] = OrderedDict()
    for is_insert, i in ops:
        k = key(i)
        if is_insert:
            if put(tier, k, i) is not None:
                assert k not in ref
                if len(ref) == slots:
                    ref.popitem(last=False)
                ref[k] = i
        elif tier.lookup([k]):
            ref.move_to_end(k)
        assert set(ref) == {key(j) for j in range(8) if tier.contains(key(j))}
    verify_contents(tier, dict(ref))


class HostTierMachine(RuleBasedStateMachine):
    """Random interleavings of every operation against a small model of what must hold."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.tier = HostTier(3 * SLOT + 3, SLOT, clock=self.clock)
        self.fills: dict[bytes, int] = {}  # READY keys -> what was written
        self.writing: dict[bytes, int] = {}
        self.leases: dict[str, tuple[list[bytes], float]] = {}  # lease -> (keys, deadline)
        self.version = 0

    @rule(i=st.integers(0, 5))
    def reserve(self, i):
        slot = self.tier.reserve(key(i))
        if slot is not None:
            assert key(i) not in self.fills and key(i) not in self.writing
            self.version = (self.version + 1) % 256
            slot.fill_(self.version)
            self.writing[key(i)] = self.version
        elif key(i) not in self.fills and key(i) not in self.writing:
            # Dropped: only allowed when the arena is full and every READY chunk is held by a
            # lease that has not timed out (WRITING ones are never evictable).
            self._forget_evicted()
            live = {k for keys, deadline in self.leases.values() if deadline > self.clock.now for k in keys}
            assert len(self.fills) + len(self.writing) == self.tier.num_slots
            assert set(self.fills) <= live

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans())
    def commit(self, data, ok):
        k = data.draw(st.sampled_from(sorted(self.writing)))
        fill = self.writing.pop(k)
        self.tier.commit(k, ok)
        if ok:
            self.fills[k] = fill

    @rule(ids=st.lists(st.integers(0, 5), max_size=3), lease=st.sampled_from([None, "a", "b"]), timeout=st.sampled_from([1.0, 5.0, float("inf")]))
    def lookup(self, ids, lease, timeout):
        keys = [key(i) for i in ids]
        found = self.tier.lookup(keys, lease, timeout)
        self._forget_evicted()
        expected = 0
        for k in keys:
            if k not in self.fills:
                break
            expected += 1
        assert found == expected
        if lease is not None:
            self.leases.pop(lease, None)
            if found:
                self.leases[lease] = (keys[:found], self.clock.now + timeout)

    @rule(lease=st.sampled_from(["a", "b"]))
    def release(self, lease):
        self.tier.release(lease)
        self.leases.pop(lease, None)

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def advance(self, dt):
        self.clock.now += dt

    @rule(i=st.integers(0, 5))
    def delete(self, i):
        k = key(i)
        if self.tier.delete(k):
            assert k in self.fills
            del self.fills[k]
        self._check_live_leases()

    def _forget_evicted(self):
        for k in [k for k in self.fills if not self.tier.contains(k)]:
            del self.fills[k]

    def _check_live_leases(self):
        for keys, deadline in self.leases.values():
            if deadline > self.clock.now:  # certainly live: its chunks must still be there
                assert all(self.tier.contains(k) for k in keys)

    @invariant()
    def bounded_and_exact(self):
        self._forget_evicted()
        stats = self.tier.stats()
        assert stats.used_bytes <= stats.capacity_bytes == self.tier.num_slots * SLOT
        assert stats.chunks == len(self.fills) <= self.tier.num_slots
        assert len(self.fills) + len(self.writing) <= self.tier.num_slots
        verify_contents(self.tier, self.fills)  # never another key's (or an evicted key's) bytes
        self._check_live_leases()

    def teardown(self):
        for k in list(self.writing):
            self.tier.commit(k, False)
        for lease in ("a", "b"):
            self.tier.release(lease)
        verify_idle(self.tier)
        assert self.tier.stats().used_bytes == len(self.fills) * SLOT


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_plain_memory_slots_start_on_a_page() -> None:
    """torch's CPU allocator aligns to 64 bytes; the arena aligns its plain segments to a page, so
    slots of a 4 KiB multiple can be written to and read from disk in place (O_DIRECT)."""
    tier = HostTier(6 * 8192, 8192)
    for i in range(6):
        tier.reserve(key(i))
    assert len(tier._slot_views) == 6 and all(v.data_ptr() % 4096 == 0 for v in tier._slot_views)
    assert all(v.numel() == 8192 for v in tier._slot_views)
