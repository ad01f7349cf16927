"""A store's or whole load's *lead* (``engine_loads.LEAD_BYTES``): with side streams the first
blocks are checked alone and enqueued before the whole block list is checked.

The promise kept in spite of the deferral: a bad id anywhere raises ``LayoutError``; nothing is
copied to or from a block past the lead; a load's lead blocks hold exactly their chunk's bytes;
a failed store caches none of its chunks; nothing (pins, slots, transfers) leaks. A plain CPU
engine checks everything first. ``ImmediateStreams`` runs the GPU paths (the store's caller-side
head, the load's side stream) on CPU, and ``LEAD_BYTES`` is shrunk to a few 64-byte blocks so a
16-block pool has operations longer than their lead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot import engine as engine_module
from kvdepot import engine_loads
from kvdepot.config import DepotConfig
from kvdepot.engine import CacheEngine
from kvdepot.engine_api import Lease
from kvdepot.errors import LayoutError
from kvdepot.layout import PoolLayout
from kvdepot.transfer import StagedBlockMover, TorchBlockMover
from kvdepot.transfer.base import ChunkCopy, split_lead
from kvdepot.transfer.streams import ImmediateStreams

TPB, BPC, BLOCKS = 2, 3, 16  # chunks of 3 blocks: a 2- or 4-block lead splits a chunk
N = 3 * BPC  # the block list of a 3-chunk (18-token) request


def _recording(base: type) -> object:
    """A real mover that also records the block ids of every gather/scatter it is asked for: the
    only way to see that a store's lead went (and nothing after it), as a store never writes the pool."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.moved: list[tuple[str, list[int]]] = []

        def gather_many(self, views, copies):
            self.moved.append(("gather", [b for c in copies for b in c.block_ids]))
            super().gather_many(views, copies)

        def scatter_many(self, copies, views):
            self.moved.append(("scatter", [b for c in copies for b in c.block_ids]))
            super().scatter_many(copies, views)

    return Recording()


@pytest.fixture
def make(monkeypatch):
    """``make(lead=, immediate=, capacity=, mover=, head_mib=)`` -> (engine, pool rows as uint8), closed
    after. ``head_mib`` 0: the store issuer, not the caller, enqueues a store's copies (as when busy)."""
    engines: list[CacheEngine] = []

    def build(*, lead: int = 2, immediate: bool = True, capacity: int = 16, mover: type = StagedBlockMover,
              head_mib: float = 16.0, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        pool = torch.randint(0, 256, (BLOCKS, 2, 2, 4 * TPB), dtype=torch.uint8, generator=gen).view(torch.float16)
        layout = PoolLayout.from_pool(pool, TPB, TPB * BPC)
        monkeypatch.setattr(engine_loads, "LEAD_BYTES", lead * layout.bytes_per_block)
        config = DepotConfig(chunk_size=TPB * BPC, host_capacity_gb=(capacity * layout.chunk_bytes + 0.5) / 1e9,
                             store_head_mib=head_mib)
        streams = {"streams": ImmediateStreams()} if immediate else {}
        engine = CacheEngine(layout, config, mover=_recording(mover), **streams)  # type: ignore[arg-type]
        engine.register_pool(pool)
        assert engine._lead_blocks == lead
        engines.append(engine)
        return engine, pool.view(torch.uint8).reshape(BLOCKS, -1)

    yield build
    for engine in engines:
        engine.close()


def _keys(engine: CacheEngine, base: int = 0) -> list:
    return engine.chunk_keys(list(range(base, base + N * TPB)))


def _ids(seed: int) -> list[int]:
    return torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[:N].tolist()


def _poison(rows: torch.Tensor, seed: int) -> torch.Tensor:
    rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return rows.clone()


def _idle(engine: CacheEngine) -> None:
    """Polled to the end, nothing of a failed operation may stay pinned, leased or in flight."""
    engine.wait_all()
    s = engine.stats()
    assert (s.live_leases, s.pinned_chunks, s.inflight_transfers) == (0, 0, 0), s


def _snapshot(engine: CacheEngine, rows: torch.Tensor, keys: list) -> tuple:
    """Everything a rejected call must leave as it was: pool bytes, each key's state, slots in use."""
    host = engine.host
    return rows.clone(), [(host.present(k), host.contains(k)) for k in keys], host.stats().used_bytes


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def _loads_exact(engine: CacheEngine, rows: torch.Tensor, keys: list, dst: list[int], stored: torch.Tensor, *, seed: int) -> None:
    """A retrieve of ``keys`` into blocks ``dst`` puts exactly ``stored`` there and writes nothing else."""
    poison = _poison(rows, seed)
    assert engine.retrieve(keys, dst) == N * TPB
    expect = poison.clone()
    expect[dst] = stored
    assert torch.equal(rows, expect)


def _round_trip(engine: CacheEngine, rows: torch.Tensor, base: int) -> None:
    """The engine still works: a fresh store, loaded into other blocks, bit-exact and nowhere else;
    lead and rest together move each block once, in list order."""
    keys, src, dst = _keys(engine, base), _ids(base), _ids(base + 1)
    stored = rows[src].clone()
    engine.mover.moved.clear()
    assert engine.store(keys, src).chunks == 3
    engine.wait_all()
    _loads_exact(engine, rows, keys, dst, stored, seed=base)
    for kind, ids in (("gather", src), ("scatter", dst)):
        assert [b for k, moved in engine.mover.moved if k == kind for b in moved] == ids
    _idle(engine)


def _bad(ids: list[int], pos: int, kind: str, lead_at: int) -> list[int]:
    """``ids`` with position ``pos`` made bad: out of the pool, or a copy of a lead id / a later id."""
    bad = list(ids)
    later = next(p for p in range(N - 1, -1, -1) if p != pos)
    bad[pos] = {"range": BLOCKS + 3, "negative": -1, "dup-lead": ids[lead_at], "dup-later": ids[later]}[kind]
    return bad


# ---- split_lead ------------------------------------------------------------------------------


def _triples(copies) -> list[tuple[int, int, int]]:
    return [(b, id(c.host), c.first + i) for c in copies for i, b in enumerate(c.block_ids)]


def test_split_lead_splits_a_chunk_at_the_lead_and_keeps_its_offsets():
    h0, h1 = torch.empty(0), torch.empty(0)
    copies = [ChunkCopy([5, 6, 7], h0, 1), ChunkCopy([2, 3], h1, 0)]
    lead, rest = split_lead(copies, 2)
    assert [(c.block_ids, c.host is h0, c.first) for c in lead] == [([5, 6], True, 1)]
    assert [(list(c.block_ids), c.first) for c in rest] == [([7], 3), ([2, 3], 0)] and rest[1] is copies[1]
    assert split_lead(copies, 3) == ([copies[0]], [copies[1]])  # a chunk boundary: nothing split
    assert split_lead(copies, 99) == (copies, []) and split_lead(copies, 0) == ([], copies)


@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=5), st.integers(0, 3)),
                       max_size=6), n=st.integers(0, 25))
def test_split_lead_covers_the_same_copies_in_order(chunks, n):
    """Lead then rest is the move itself (block, buffer, position, in order); the lead is its first
    min(n, total) blocks; neither part holds an empty chunk part."""
    copies = [ChunkCopy(ids, torch.empty(0), first) for ids, first in chunks]
    lead, rest = split_lead(copies, n)
    assert _triples(lead) + _triples(rest) == _triples(copies)
    assert sum(len(c.block_ids) for c in lead) == min(n, sum(len(ids) for ids, _ in chunks))
    assert all(c.block_ids for c in lead + rest)


# ---- a bad id past the lead ------------------------------------------------------------------


@pytest.mark.parametrize("mover", [StagedBlockMover, TorchBlockMover], ids=["staged", "runs"])
@pytest.mark.parametrize(("lead", "skip", "pos", "kind"), [
    (2, 0, 8, "range"), (2, 0, 2, "negative"), (4, 1, 7, "dup-lead"), (2, 3, 6, "dup-later"), (4, 0, 4, "range"),
])
def test_a_load_with_a_bad_id_past_the_lead_writes_only_its_lead(make, mover, lead, skip, pos, kind):
    """The lead (the first ``lead`` blocks from ``skip``) was scattered before the full check: those
    blocks hold their stored bytes exactly; every other block, listed or not, is untouched."""
    engine, rows = make(lead=lead, mover=mover)
    keys, src, dst = _keys(engine), _ids(1), _ids(2)
    stored = rows[src].clone()
    engine.store(keys, src).wait()
    poison = _poison(rows, 3)
    bad, lead_pos = _bad(dst, pos, kind, skip), range(skip, skip + lead)
    engine.mover.moved.clear()
    with pytest.raises(LayoutError):
        engine.retrieve(keys, bad, skip_blocks=skip)
    assert engine.mover.moved == [("scatter", [dst[p] for p in lead_pos])]  # the lead went, nothing after it
    expect = poison.clone()
    expect[[dst[p] for p in lead_pos]] = stored[list(lead_pos)]
    assert torch.equal(rows, expect)
    _idle(engine)
    _loads_exact(engine, rows, keys, dst, stored, seed=4)  # the chunks are still cached, intact
    _round_trip(engine, rows, 100)


@pytest.mark.parametrize("head", [True, False], ids=["caller-head", "issuer-only"])
@pytest.mark.parametrize(("cached_first", "pos", "kind"), [
    (False, 8, "range"), (False, 5, "dup-lead"), (True, 0, "negative"), (True, 8, "dup-later"),
])
def test_a_store_with_a_bad_id_past_the_lead_caches_nothing_and_leaks_nothing(make, head, cached_first, pos, kind):
    """At most the lead of the chunks placed (after the one cached, with ``cached_first``) was
    gathered: by the caller when it may enqueue a store's head, else nothing (the issuer gets the
    lead and the rest only once checked). The reservations are undone; a correct store then works."""
    engine, rows = make(lead=2, head_mib=16.0 if head else 0.0)
    keys, src = _keys(engine), _ids(1)
    if cached_first:
        engine.store(keys[:1], src[:BPC]).wait()
    used = engine.host.stats().used_bytes
    first = BPC if cached_first else 0  # where the store's copies (and so its lead) start
    engine.mover.moved.clear()
    with pytest.raises(LayoutError):
        engine.store(keys, _bad(src, pos, kind, first))
    # A bad id among the request's first lead blocks is refused before anything is reserved.
    assert engine.mover.moved == ([("gather", src[first : first + 2])] if head and pos >= 2 else [])
    _idle(engine)
    assert engine.lookup(keys) == (BPC * TPB if cached_first else 0)
    assert [engine.host.present(k) for k in keys] == [cached_first, False, False]
    assert engine.host.stats().used_bytes == used  # the reserved slots are free again
    stored = rows[src].clone()
    assert engine.store(keys, src).chunks == 3 - cached_first
    engine.wait_all()
    _loads_exact(engine, rows, keys, src, stored, seed=5)
    _round_trip(engine, rows, 200)


@pytest.mark.parametrize(("pos", "lead_went"), [(6, False), (7, True), (8, True)])
def test_a_stores_lead_stops_at_a_cached_chunk(make, pos, lead_went):
    """The lead's ids are checked as the list's first ``lead`` positions from where copies start;
    a cached chunk inside that span must end the lead there, or the lead would copy (from outside
    the pool, on a GPU) blocks at later positions whose ids nobody had checked."""
    engine, rows = make(lead=7)  # 7 positions: chunk 0, cached chunk 1, a block of chunk 2
    keys, src = _keys(engine), _ids(1)
    engine.store(keys[1:2], src[BPC : 2 * BPC]).wait()
    used = engine.host.stats().used_bytes
    engine.mover.moved.clear()
    with pytest.raises(LayoutError):
        engine.store(keys, _bad(src, pos, "range", 0))
    # Position 6 is inside the checked span: refused before anything; past it, only chunk 0 went.
    assert engine.mover.moved == ([("gather", src[:BPC])] if lead_went else [])
    _idle(engine)
    assert [engine.host.present(k) for k in keys] == [False, True, False]
    assert engine.host.stats().used_bytes == used
    _round_trip(engine, rows, 600)


# ---- checked before anything moves ---------------------------------------------------------


def _rejects_untouched(engine: CacheEngine, rows: torch.Tensor, call) -> None:
    """``call`` raises LayoutError having moved nothing: mover never called, pool, keys, slots as they were."""
    cached, fresh = _keys(engine), _keys(engine, 1000)
    before = _snapshot(engine, rows, cached + fresh)
    engine.mover.moved.clear()
    with pytest.raises(LayoutError):
        call(cached, fresh)
    assert engine.mover.moved == []
    assert _same(_snapshot(engine, rows, cached + fresh), before)
    _idle(engine)


IN_LEAD = {  # name: (lead, call(engine, cached keys, fresh keys)); the bad id is where the lead starts or in it
    "store-first": (2, lambda e, c, f: e.store(f, _bad(_ids(2), 0, "range", 0))),
    "store-in": (2, lambda e, c, f: e.store(f, _bad(_ids(2), 1, "negative", 0))),
    "store-split": (4, lambda e, c, f: e.store(f, _bad(_ids(2), 3, "dup-lead", 0))),
    "store-after-a-hit": (2, lambda e, c, f: e.store(c[:1] + f[1:], _bad(_ids(2), BPC + 1, "range", 0))),
    "store-whole": (16, lambda e, c, f: e.store(f, _bad(_ids(2), 8, "range", 0))),
    "load-in": (2, lambda e, c, f: e.retrieve(c, _bad(_ids(2), 1, "range", 0))),
    "load-split": (4, lambda e, c, f: e.retrieve(c, _bad(_ids(2), 3, "dup-lead", 0))),
    "load-after-skip": (2, lambda e, c, f: e.retrieve(c, _bad(_ids(2), 4, "range", 0), skip_blocks=3)),
    # The lead repeats a skipped block (KV the engine holds): never written, whatever the lead.
    "load-repeats-a-skipped-block": (2, lambda e, c, f: e.retrieve(c, _bad(_ids(2), 3, "dup-lead", 0), skip_blocks=3)),
    "load-whole": (16, lambda e, c, f: e.retrieve(c, _bad(_ids(2), 8, "range", 0))),
}


@pytest.mark.parametrize("case", IN_LEAD)
def test_a_bad_id_inside_the_lead_raises_before_anything_is_copied(make, case):
    """The lead is the operation's first blocks in copy order: from ``skip_blocks``, or from the
    first chunk not cached. ``whole``: a lead longer than the operation, checked in full first."""
    lead, call = IN_LEAD[case]
    engine, rows = make(lead=lead)
    engine.store(_keys(engine), _ids(1)).wait()
    _rejects_untouched(engine, rows, lambda cached, fresh: call(engine, cached, fresh))
    _round_trip(engine, rows, 300)


@pytest.mark.parametrize("case", ["nothing-cached", "skip-past-end", "no-blocks", "all-cached-store"])
def test_the_deferred_check_runs_where_nothing_is_copied(make, case):
    """Early returns (no hit; nothing asked for; a store of chunks all cached) still raise for a
    bad id past the lead: the check put off for the lead is never skipped."""
    engine, rows = make(lead=2)
    engine.store(_keys(engine), _ids(1)).wait()
    bad = _bad(_ids(2), 7, "range", 0)
    call = {
        "nothing-cached": lambda cached, fresh: engine.retrieve(fresh, bad),
        "skip-past-end": lambda cached, fresh: engine.retrieve(cached, bad, skip_blocks=N),
        "no-blocks": lambda cached, fresh: engine.retrieve(cached, bad, num_blocks=0),
        "all-cached-store": lambda cached, fresh: engine.store(cached, bad),
    }[case]
    _rejects_untouched(engine, rows, call)


@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_a_cpu_engine_checks_every_id_before_copying(make, op):
    """No side streams, no lead: the same bad id past where a lead would end moves nothing at all,
    and a full host tier loses nothing (the ids are checked before any slot is reserved)."""
    engine, rows = make(lead=2, immediate=False, capacity=3)
    assert engine._transfers.streams is None
    engine.store(_keys(engine), _ids(1)).wait()
    bad = _bad(_ids(2), 7, "range", 0)
    if op == "store":
        _rejects_untouched(engine, rows, lambda cached, fresh: engine.store(fresh, bad))
    else:
        _rejects_untouched(engine, rows, lambda cached, fresh: engine.retrieve(cached, bad))
    _round_trip(engine, rows, 400)


def test_a_store_books_the_chunks_past_its_lead_only_once_the_lead_is_enqueued(make, monkeypatch):
    """Booking evicts, and on a GPU host it was a quarter of the time before a store's first copy
    (issue 19): the lead's chunk is booked, its copies go, and only then the other chunks."""
    engine, rows = make(lead=2)
    log = engine.mover.moved
    reserve = engine.host.reserve_many

    def logged(keys, **kw):
        log.append(("book", len(keys)))
        return reserve(keys, **kw)

    monkeypatch.setattr(engine.host, "reserve_many", logged)
    src = _ids(1)
    stored = rows[src].clone()
    assert engine.store(_keys(engine), src).chunks == 3
    engine.wait_all()
    assert log == [("book", 1), ("gather", src[:2]), ("book", 2), ("gather", src[2:])]
    _loads_exact(engine, rows, _keys(engine), src, stored, seed=9)
    _idle(engine)


def test_a_stores_lead_is_enqueued_before_the_store_is_tracked(make, monkeypatch):
    """What the store needs only later (its record in the FIFO, its commit, the move over its
    other chunks) is made while the lead copies, not before it (issue 19, sixteenth pass)."""
    engine, rows = make(lead=2)
    gather, seen = engine.mover.gather_many, []

    def watched(views, copies):
        seen.append((len(copies), len(engine._transfers.inflight)))  # white box: the FIFO
        gather(views, copies)

    monkeypatch.setattr(engine.mover, "gather_many", watched)
    assert engine.store(_keys(engine), _ids(1)).chunks == 3
    engine.wait_all()
    assert seen[0] == (1, 0)  # the lead (one chunk's part), before the store was tracked
    _round_trip(engine, rows, 700)


@pytest.mark.parametrize("where", ["lead", "after-lead"])
def test_a_store_that_fails_around_its_lead_caches_nothing_and_leaks_nothing(make, monkeypatch, where):
    """The lead's copies cannot be enqueued (``lead``), or the store stops between its lead and
    its hand-off (``after-lead``: an interrupt there): the error reaches the caller, the lead's
    slot is freed once its copies have run, and the next store's head is the caller's again
    (no store counted as queued for the issuer)."""
    engine, rows = make(lead=2)
    if where == "lead":
        def refuse(views, copies):
            raise RuntimeError("injected: the driver refused the lead")

        monkeypatch.setattr(engine.mover, "gather_many", refuse)
    else:
        def interrupted(make_move):
            raise RuntimeError("injected: stopped after the lead")

        monkeypatch.setattr(engine_module, "LateMove", interrupted)
    keys = _keys(engine, 2000)
    with pytest.raises(RuntimeError, match="injected"):
        engine.store(keys, _ids(3))
    _idle(engine)
    assert [engine.host.present(k) for k in keys] == [False] * 3 and engine.host.stats().used_bytes == 0
    assert engine._transfers._queued == 0  # white box: an idle issuer, as before the store
    monkeypatch.undo()
    _round_trip(engine, rows, 800)


@pytest.mark.parametrize(("pos", "kept"), [(1, [True, True, True]), (7, [False, True, True])], ids=["in-lead", "past-lead"])
def test_a_store_with_a_bad_id_costs_a_full_cache_at_most_its_leads_slot(make, pos, kept):
    """A bad id among a store's first blocks is refused before anything is booked: as on a CPU
    engine, a full host tier keeps its chunks. One past the lead is found before the chunks past
    the lead are booked: it has cost only the chunk the lead's slot was taken from (the oldest)."""
    engine, rows = make(lead=2, capacity=3)
    keys = _keys(engine)
    engine.store(keys, _ids(1)).wait()
    with pytest.raises(LayoutError):
        engine.store(_keys(engine, 1000), _bad(_ids(2), pos, "range", 0))
    _idle(engine)
    assert [engine.host.present(k) for k in keys] == kept
    assert engine.host.stats().used_bytes == sum(kept) * engine.layout.chunk_bytes
    _round_trip(engine, rows, 500)


@pytest.mark.parametrize(("streams", "lead", "where"), [
    ("immediate", 2, "inside-lead"), ("immediate", 2, "past-lead"), ("immediate", 16, "whole"),
    ("cpu", 2, "past-lead"), ("immediate", 2, "negative-skip"),
])
def test_a_load_that_raises_has_released_its_lease(make, streams, lead, where):
    """Wherever a load with a lease fails on bad input (its lead's ids, the ids after the lead
    once the lead is copied, the whole list, a bad ``skip_blocks``), the lookup's pins are gone when
    it raises: none of it waits for the lease's timeout. The chunks stay cached and load again."""
    engine, rows = make(lead=lead, immediate=streams == "immediate")
    keys, src, dst = _keys(engine), _ids(1), _ids(2)
    stored = rows[src].clone()
    engine.store(keys, src).wait()
    lease = Lease("req-1")
    assert engine.lookup(keys, lease=lease) == N * TPB
    assert engine.stats().live_leases == 1
    bad = {"inside-lead": _bad(dst, 1, "range", 0), "past-lead": _bad(dst, 7, "range", 0),
           "whole": _bad(dst, 7, "dup-lead", 0), "negative-skip": dst}[where]
    with pytest.raises(LayoutError):
        engine.retrieve(keys, bad, lease=lease, skip_blocks=-1 if where == "negative-skip" else 0)
    _idle(engine)  # no lease, no pins, nothing in flight: without a release call
    poison = _poison(rows, 5)
    assert engine.lookup(keys, lease=lease) == N * TPB
    assert engine.retrieve(keys, dst, lease=lease) == N * TPB
    expect = poison.clone()
    expect[dst] = stored
    assert torch.equal(rows, expect)
    _idle(engine)


def test_a_load_pins_the_chunks_past_its_lead_only_once_the_lead_is_enqueued(make, monkeypatch):
    """Pinning and listing every chunk of a load took 16-40 us before its first copy on H100 hosts
    (issue 19, tenth pass): the lead's chunk is pinned, its copies go, and only then the others."""
    engine, rows = make(lead=2)
    keys, src, dst = _keys(engine), _ids(1), _ids(2)
    stored = rows[src].clone()
    engine.store(keys, src).wait()
    log = engine.mover.moved
    log.clear()
    pin = engine.host.pin

    def logged(lease, pinned, *args, **kw):
        log.append(("pin", len(pinned)))
        return pin(lease, pinned, *args, **kw)

    monkeypatch.setattr(engine.host, "pin", logged)
    poison = _poison(rows, 9)
    assert engine.retrieve(keys, dst) == N * TPB
    assert log == [("pin", 1), ("scatter", dst[:2]), ("pin", 2), ("scatter", dst[2:])]
    expect = poison.clone()
    expect[dst] = stored
    assert torch.equal(rows, expect)
    _idle(engine)


def _stored_and_leased(make, leased: bool) -> tuple:
    """A lead of 2 blocks, a 3-chunk request stored (its bytes kept) and, with ``leased``, looked
    up under a lease: (engine, rows, keys, stored bytes, block ids to load into, lease or None)."""
    engine, rows = make(lead=2)
    keys, src, dst = _keys(engine), _ids(1), _ids(2)
    stored = rows[src].clone()
    engine.store(keys, src).wait()
    lease = Lease("req-1") if leased else None
    if leased:
        assert engine.lookup(keys, lease=lease) == N * TPB
    return engine, rows, keys, stored, dst, lease


@pytest.mark.parametrize("leased", [False, True], ids=["no-lease", "lease"])
def test_a_chunk_deleted_while_the_lead_copies_ends_the_load_before_it(make, leased):
    """Between the lead and the pins of the chunks after it, a chunk past the lead goes (deleted;
    an eviction does the same): the load ends before it, reports only what it wrote, and writes
    nothing of it or after it. Under a lookup's lease nothing can go: the load is whole."""
    engine, rows, keys, stored, dst, lease = _stored_and_leased(make, leased)
    scatter, deleted = engine.mover.scatter_many, []

    def scatter_then_delete(copies, views):
        scatter(copies, views)
        if not deleted:  # the lead: the middle chunk goes while it copies
            with engine._lock:
                deleted.append(engine.host.delete(keys[1]))

    engine.mover.scatter_many = scatter_then_delete
    poison = _poison(rows, 7)
    loaded = engine.retrieve(keys, dst, lease=lease)
    assert deleted == [not leased]
    whole = N if leased else BPC  # blocks loaded: all, or the first chunk's
    assert loaded == whole * TPB
    expect = poison.clone()
    expect[dst[:whole]] = stored[:whole]
    assert torch.equal(rows, expect)  # the deleted chunk's blocks and the ones after it untouched
    _idle(engine)


@pytest.mark.parametrize("leased", [False, True], ids=["no-lease", "lease"])
def test_a_load_whose_lead_cannot_be_enqueued_releases_its_lease_and_pins(make, leased):
    """The lease is released with the pins of the chunks past the lead, after the lead: where the
    lead's own copies fail to enqueue, the load still leaves no lease and no pin behind."""
    engine, rows, keys, stored, dst, lease = _stored_and_leased(make, leased)
    scatter = engine.mover.scatter_many

    def refuse(copies, views):
        raise RuntimeError("injected: the driver refused the lead")

    engine.mover.scatter_many = refuse
    with pytest.raises(RuntimeError, match="injected"):
        engine.retrieve(keys, dst, lease=lease)
    _idle(engine)  # no lease, no pins, nothing in flight
    engine.mover.scatter_many = scatter
    _loads_exact(engine, rows, keys, dst, stored, seed=11)
    _idle(engine)
