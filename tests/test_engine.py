"""``kvdepot.engine.CacheEngine``: store -> lookup -> retrieve, byte for byte, on CPU and CUDA.

The central property: for random geometries, dtypes (compared as uint8: bit-exact, NaN
patterns included), block ids in random order and random partial hits, a retrieve puts back
exactly the bytes a store took and writes no other block (the whole pool is poisoned with a
known random pattern first). Around it: eviction under a byte bound, leases that always come
back to zero, bad input that raises and leaves the cache as it was, and several threads on
one engine. Tests marked ``gpu`` repeat the round trip on CUDA with the engine's side streams
and check the stream ordering both ways.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvdepot.transfer as transfer
from fakes import FakeClock
from kvdepot.config import DepotConfig
from kvdepot.engine import CacheEngine
from kvdepot.errors import ConfigError, LayoutError
from kvdepot.layout import PoolLayout
from kvdepot.transfer.layered import LAYERS_AHEAD

DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]
# Every registered mover must meet the same contract (the registry may not exist in older trees).
MOVERS = getattr(transfer, "MOVERS", {"runs": transfer.TorchBlockMover})


class Rig:
    """One pool filled with random bytes, its engine, and byte-level helpers."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float16,
        tpb: int = 4,
        bpc: int = 2,
        layers: int = 2,
        kv: int = 2,
        row: int = 2,
        num_blocks: int = 16,
        capacity_chunks: int = 64,
        seed: int = 0,
        mover: str | None = None,
        clock: FakeClock | None = None,
        **config: object,
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.num_blocks, self.tpb = device, num_blocks, tpb
        self.chunk = tpb * bpc
        self.pool = torch.empty(num_blocks, layers, kv, tpb * row, dtype=dtype, device=device)
        self.chunk_bytes = bpc * self.pool[0].numel() * self.pool.element_size()
        self.capacity = capacity_chunks * self.chunk_bytes
        self.config = DepotConfig(
            chunk_size=self.chunk, host_capacity_gb=(self.capacity + 0.5) / 1e9, **config  # type: ignore[arg-type]
        )
        self.fill()
        self.clock = clock or FakeClock()
        layout = PoolLayout.from_pool(self.pool, tpb, self.chunk)
        self.engine = CacheEngine(layout, self.config, mover=MOVERS[mover]() if mover else None, clock=self.clock)
        self.engine.register_pool(self.pool)

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.gen)

    def rows(self) -> torch.Tensor:
        """The pool as uint8 rows, one per block, copied to the CPU."""
        return self.pool.view(torch.uint8).reshape(self.num_blocks, -1).cpu().clone()

    def fill(self, ids: list[int] | None = None) -> torch.Tensor:
        """Write fresh random bytes into blocks ``ids`` (all if None); return all rows after."""
        rows = self.pool.view(torch.uint8).reshape(self.num_blocks, -1)
        if ids is None:
            rows.copy_(self.random(*rows.shape).to(self.device))
        elif ids:
            rows[torch.tensor(ids, device=self.device)] = self.random(len(ids), rows.shape[1]).to(self.device)
        return self.rows()

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, 2**32, (n,), dtype=torch.int64, generator=self.gen).tolist()

    def ids(self, n: int) -> list[int]:
        return torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()

    def verify_idle(self) -> None:
        stats = self.engine.stats()
        assert (stats.live_leases, stats.pinned_chunks, stats.inflight_transfers) == (0, 0, 0), stats


def verify_rows(now: torch.Tensor, expected: dict[int, torch.Tensor], otherwise: torch.Tensor) -> None:
    """Blocks in ``expected`` hold those bytes; every other block is byte-for-byte ``otherwise``."""
    for b in range(now.shape[0]):
        assert torch.equal(now[b], expected[b] if b in expected else otherwise[b]), f"block {b}"


def expected_load(n_keys: int, stored: int, bpc: int, n_ids: int, skip: int, count: int | None) -> range:
    """Positions in the block list a retrieve must write, from the documented rules."""
    end = min(n_keys * bpc, n_ids)
    if count is not None:
        end = min(end, skip + count)
    return range(skip, max(skip, min(end, stored * bpc)))


# ---- the round trip --------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    tpb = draw(st.sampled_from([1, 2, 4, 8]))
    bpc = draw(st.integers(1, 3))
    full = draw(st.integers(0, 4))
    num_tokens = full * tpb * bpc + draw(st.integers(0, tpb * bpc - 1))
    n_ids = -(-num_tokens // tpb) + draw(st.integers(0, 2))
    return dict(
        rig=dict(
            dtype=draw(st.sampled_from(DTYPES)),
            tpb=tpb,
            bpc=bpc,
            layers=draw(st.integers(1, 3)),
            kv=draw(st.sampled_from([1, 2])),
            row=draw(st.integers(1, 4)),
            num_blocks=max(n_ids, 1) + draw(st.integers(0, 4)),
            seed=draw(st.integers(0, 2**31 - 1)),
            hash_algo=draw(st.sampled_from(["blake3", "xxh3_128"])),
        ),
        num_tokens=num_tokens,
        n_ids=n_ids,
        stored=draw(st.integers(0, full)),  # chunks stored: the rest is a partial hit
        skip=draw(st.integers(0, n_ids + 1)),
        count=draw(st.one_of(st.none(), st.integers(0, n_ids + 1))),
        lease=draw(st.booleans()),
        wait_all=draw(st.booleans()),
    )


def round_trip(s: dict, device: str = "cpu", mover: str | None = None) -> None:
    rig = Rig(device=device, mover=mover, **s["rig"])
    engine, bpc, B = rig.engine, s["rig"]["bpc"], s["rig"]["tpb"]
    tokens, ids = rig.tokens(s["num_tokens"]), rig.ids(s["n_ids"])
    stored = s["stored"]
    original = rig.rows()

    handle = engine.store(engine.chunk_keys(tokens[: stored * rig.chunk]), ids)
    engine.wait_all() if s["wait_all"] else handle.wait()
    assert handle.done() and handle.chunks == stored
    assert torch.equal(rig.rows(), original)  # a store never writes the pool
    stats = engine.stats()
    assert (stats.stored_chunks, stats.host_chunks, stats.bytes_stored) == (stored, stored, stored * rig.chunk_bytes)
    assert engine.store(engine.chunk_keys(tokens[: stored * rig.chunk]), ids).chunks == 0  # already cached: nothing to copy

    lease = ("req", 1) if s["lease"] else None
    assert engine.lookup(engine.chunk_keys(tokens), lease=lease) == stored * rig.chunk
    poison = rig.fill()
    got = engine.retrieve(engine.chunk_keys(tokens), ids, skip_blocks=s["skip"], num_blocks=s["count"], lease=lease)
    positions = expected_load(len(tokens) // rig.chunk, stored, bpc, len(ids), s["skip"], s["count"])
    assert got == (positions.stop if positions else s["skip"]) * B
    verify_rows(rig.rows(), {ids[p]: original[ids[p]] for p in positions}, poison)
    engine.poll()
    stats = engine.stats()
    assert stats.bytes_loaded == len(positions) * (rig.chunk_bytes // bpc)
    assert stats.loaded_chunks == len({p // bpc for p in positions})
    rig.verify_idle()


@settings(max_examples=80, deadline=None)
@given(s=scenarios())
def test_store_then_retrieve_is_bit_exact_and_touches_nothing_else(s):
    round_trip(s)


@pytest.mark.parametrize("mover", sorted(MOVERS))
@settings(max_examples=15, deadline=None)
@given(s=scenarios())
def test_round_trip_with_every_registered_mover(mover, s):
    round_trip(s, mover=mover)


def test_lookup_skip_tokens_and_a_prefix_of_the_keys():
    rig = Rig(tpb=4, bpc=2)  # chunk of 8 tokens
    engine = rig.engine
    tokens, ids = rig.tokens(30), rig.ids(8)  # 3 full chunks + 6 tokens
    keys = engine.chunk_keys(tokens)
    assert len(keys) == 3
    engine.store(keys[:3], ids[:6]).wait()  # 3 chunks, 6 blocks
    assert engine.lookup(engine.chunk_keys(tokens)) == 24
    assert engine.lookup(keys) == 24
    assert engine.lookup(engine.chunk_keys(tokens), skip_tokens=8) == 24  # counted from the second chunk
    assert engine.lookup(engine.chunk_keys(tokens), skip_tokens=12) == 24  # rounds down to its chunk
    assert engine.lookup(engine.chunk_keys(tokens + [0] * 2)) == 24  # 32 tokens = 4 chunks, the 4th not cached
    original = rig.rows()
    poison = rig.fill()
    assert engine.retrieve(keys, ids, skip_blocks=2) == 24
    verify_rows(rig.rows(), {ids[p]: original[ids[p]] for p in range(2, 6)}, poison)
    rig.verify_idle()


def test_a_new_pool_of_the_same_geometry_receives_cached_chunks():
    rig = Rig(num_blocks=8)
    tokens, ids = rig.tokens(16), [5, 2, 7, 0]
    original = rig.rows()
    rig.engine.store(rig.engine.chunk_keys(tokens), ids).wait()
    bigger = torch.zeros(12, *rig.pool.shape[1:], dtype=rig.pool.dtype)  # e.g. after a reload
    rig.engine.register_pool(bigger)
    assert rig.engine.retrieve(rig.engine.chunk_keys(tokens), [11, 3, 9, 4]) == 16
    new_rows = bigger.view(torch.uint8).reshape(12, -1)
    expected = {11: original[5], 3: original[2], 9: original[7], 4: original[0]}
    verify_rows(new_rows, expected, torch.zeros_like(new_rows))
    assert torch.equal(rig.rows(), original)  # the old pool is no longer written


# ---- eviction under a byte bound ---------------------------------------------------------------


def test_eviction_keeps_the_bound_and_never_serves_evicted_data():
    rig = Rig(tpb=4, bpc=1, capacity_chunks=3)
    engine, ids = rig.engine, [6, 1]
    seqs, data = [], []
    for _ in range(5):  # five one-chunk sequences through the same block
        seqs.append(rig.tokens(4))
        data.append(rig.fill()[ids[0]])
        engine.store(engine.chunk_keys(seqs[-1]), ids[:1]).wait()
        host = engine.host.stats()
        assert host.used_bytes <= host.capacity_bytes == rig.capacity
        assert engine.stats().host_chunks <= engine.stats().host_capacity_chunks == 3
    assert engine.stats().evictions == 2
    assert [engine.lookup(engine.chunk_keys(seq)) for seq in seqs] == [0, 0, 4, 4, 4]  # the two coldest are gone
    for i, seq in enumerate(seqs):
        poison = rig.fill()
        got = engine.retrieve(engine.chunk_keys(seq), ids[:1])
        if i < 2:
            assert got == 0
            assert torch.equal(rig.rows(), poison)
        else:
            assert got == 4
            verify_rows(rig.rows(), {ids[0]: data[i]}, poison)  # this chunk's bytes, not a slot's old ones
    rig.verify_idle()


def test_an_evicted_head_breaks_the_chain_but_the_engine_can_skip_it():
    rig = Rig(tpb=2, bpc=2, capacity_chunks=3)
    engine = rig.engine
    a, b = rig.tokens(8), rig.tokens(8)
    ids = rig.ids(4)
    a_rows = rig.rows()
    engine.store(engine.chunk_keys(a), ids).wait()
    rig.fill()
    engine.store(engine.chunk_keys(b), ids).wait()  # needs 2 slots: evicts a's chunk 0 (the coldest)
    assert engine.stats().evictions == 1
    assert engine.lookup(engine.chunk_keys(a)) == 0  # chained keys: without chunk 0 nothing counts
    poison = rig.fill()
    assert engine.retrieve(engine.chunk_keys(a), ids) == 0 and torch.equal(rig.rows(), poison)
    # An engine that still holds chunk 0 on device loads chunk 1 from the cache.
    assert engine.retrieve(engine.chunk_keys(a), ids, skip_blocks=2) == 8
    verify_rows(rig.rows(), {ids[2]: a_rows[ids[2]], ids[3]: a_rows[ids[3]]}, poison)
    rig.verify_idle()


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 4),
    lengths=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_stores_and_hits_under_capacity(capacity, lengths, ops, seed):
    """Any order of stores and hits: bounded, and every hit loads exactly its own chunk's bytes."""
    rig = Rig(tpb=2, bpc=1, num_blocks=3 * len(lengths), capacity_chunks=capacity, seed=seed)
    engine = rig.engine
    seqs = [(rig.tokens(2 * n), list(range(3 * i, 3 * i + n))) for i, n in enumerate(lengths)]
    canonical = rig.rows()  # each sequence's blocks hold its canonical bytes
    for is_store, i in ops:
        tokens, ids = seqs[i % len(seqs)]
        if is_store:
            rows = rig.pool.view(torch.uint8).reshape(rig.num_blocks, -1)
            rows.copy_(canonical)
            engine.store(engine.chunk_keys(tokens), ids).wait()
        else:
            hit = engine.lookup(engine.chunk_keys(tokens), lease="req") // 2
            poison = rig.fill()
            assert engine.retrieve(engine.chunk_keys(tokens), ids, lease="req") == 2 * hit
            verify_rows(rig.rows(), {ids[c]: canonical[ids[c]] for c in range(hit)}, poison)
        host = engine.host.stats()
        assert host.used_bytes <= rig.capacity and host.chunks <= capacity
        rig.verify_idle()


# ---- leases --------------------------------------------------------------------------------


def test_pinned_chunks_block_eviction_until_released():
    rig = Rig(tpb=4, bpc=1, capacity_chunks=2)
    engine = rig.engine
    a, b, c = rig.tokens(4), rig.tokens(4), rig.tokens(4)
    engine.store(engine.chunk_keys(a), [0]).wait()
    engine.store(engine.chunk_keys(b), [1]).wait()
    assert engine.lookup(engine.chunk_keys(a), lease="ra") == 4 and engine.lookup(engine.chunk_keys(b), lease="rb") == 4
    assert engine.stats().pinned_chunks == 2 and engine.stats().live_leases == 2
    handle = engine.store(engine.chunk_keys(c), [2])
    assert handle.chunks == 0 and engine.stats().dropped_stores == 1 and engine.lookup(engine.chunk_keys(c)) == 0
    engine.release("ra")
    assert engine.store(engine.chunk_keys(c), [2]).chunks == 1  # a is evictable now
    assert engine.lookup(engine.chunk_keys(a)) == 0 and engine.lookup(engine.chunk_keys(b)) == 4 and engine.lookup(engine.chunk_keys(c)) == 4
    engine.release("rb")
    rig.verify_idle()


def test_a_retrieve_releases_the_lookup_lease_even_when_nothing_is_loaded():
    rig = Rig(tpb=4, bpc=1)
    tokens, ids = rig.tokens(8), rig.ids(2)
    rig.engine.store(rig.engine.chunk_keys(tokens), ids).wait()
    for skip, count in ((0, 0), (2, None), (5, 1)):
        assert rig.engine.lookup(rig.engine.chunk_keys(tokens), lease="r") == 8
        assert rig.engine.retrieve(rig.engine.chunk_keys(tokens), ids, skip_blocks=skip, num_blocks=count, lease="r") == skip * 4
        rig.verify_idle()


def test_lease_timeout_on_the_engine():
    rig = Rig(tpb=4, bpc=1, capacity_chunks=1, lease_timeout_s=1.0)
    engine = rig.engine
    a, b = rig.tokens(4), rig.tokens(4)
    engine.store(engine.chunk_keys(a), [0]).wait()
    assert engine.lookup(engine.chunk_keys(a), lease="never-loaded") == 4
    rig.clock.advance(0.999)
    assert engine.stats().live_leases == 1  # not yet: the engine's clock, not the machine's, decides
    rig.clock.advance(0.001)
    rig.verify_idle()  # the lease timed out
    assert engine.store(engine.chunk_keys(b), [1]).chunks == 1  # and does not keep the only slot pinned
    assert engine.lookup(engine.chunk_keys(a)) == 0 and engine.lookup(engine.chunk_keys(b)) == 4
    # A lease that times out before its retrieve: the retrieve still loads what is there.
    assert engine.lookup(engine.chunk_keys(b), lease="late") == 4
    rig.clock.advance(1.0)
    assert engine.retrieve(engine.chunk_keys(b), [3], lease="late") == 4
    rig.verify_idle()


def test_try_probe_and_try_release_never_wait_for_the_engine():
    """The non-blocking variants (the server's loop thread): the same answers as ``probe`` and
    ``release`` while the engine is free; None/False, with nothing done, while another thread
    holds it."""
    rig = Rig(tpb=4, bpc=1)
    engine = rig.engine
    keys = engine.chunk_keys(rig.tokens(8))
    engine.store(keys, [0, 1]).wait()
    assert engine.try_probe(keys, lease="t") == engine.probe(keys) and engine.stats().live_leases == 1
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with engine._lock:  # white box: as a copy's bookkeeping or a pool swap would
            held.set()
            go.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        before = engine.stats  # stats() would wait for the lock too: read after
        assert engine.try_probe(keys, lease="u") is None
        assert engine.try_release("t") is False
    finally:
        go.set()
        holder.join(10)
    stats = before()
    assert stats.live_leases == 1 and stats.lookups == 2  # "u" never probed, "t" still held
    assert engine.try_release("t") is True
    rig.verify_idle()


def test_try_probe_declines_where_lower_tiers_would_do_io(tmp_path):
    rig = Rig(tpb=4, bpc=1, disk_path=str(tmp_path), disk_capacity_gb=0.001)
    keys = rig.engine.chunk_keys(rig.tokens(8))
    assert rig.engine.try_probe(keys, lease="t") is None and rig.engine.stats().lookups == 0
    assert rig.engine.probe(keys).tokens == 0  # the blocking probe still answers (nothing stored)
    rig.engine.close()


def test_write_behind_lends_the_host_slot_in_place_and_pinned_until_written(tmp_path):
    """The disk gets the committed slot's own memory (no copy under the GIL), the chunk pinned
    while it is written (nothing can evict or reuse the slot) and unpinned once it is."""
    rig = Rig(tpb=4, bpc=1, disk_path=str(tmp_path), disk_capacity_gb=0.01)
    engine = rig.engine
    disk = engine.lower.disk
    seen = []
    put = disk.put

    def spy(key, payload):
        view = np.frombuffer(payload, dtype=np.uint8)
        seen.append((view.ctypes.data, bytes(view), engine.stats().pinned_chunks))
        return put(key, payload)

    disk.put = spy
    keys = engine.chunk_keys(rig.tokens(4))
    engine.store(keys, rig.ids(1)).wait()
    engine.poll()
    engine.lower.flush()
    slot = engine.host.slot(keys[0])
    assert seen == [(slot.data_ptr(), bytes(slot.numpy()), 1)]
    assert disk.get(keys[0]) == bytes(slot.numpy())
    rig.verify_idle()
    engine.close()


# ---- bad input: a clear exception, and the cache exactly as it was -----------------------------------


def snapshot(rig: Rig, keys: list) -> tuple:
    stats = dataclasses.asdict(rig.engine.stats())
    host = {k: (rig.engine.host.contains(k), rig.engine.host.slot(k).clone() if rig.engine.host.contains(k) else None) for k in keys}
    return stats, host, rig.rows()


def same(a: tuple, b: tuple) -> bool:
    (sa, ha, ra), (sb, hb, rb) = a, b
    slots_equal = all(ha[k][0] == hb[k][0] and (ha[k][1] is None or torch.equal(ha[k][1], hb[k][1])) for k in ha)
    return sa == sb and slots_equal and torch.equal(ra, rb)


BAD_CALLS = [
    # (id, call(engine, tokens, ids), exception, message fragment)
    ("store-too-few-ids", lambda e, t, i: e.store(e.chunk_keys(t), i[:3]), LayoutError, "cannot hold"),
    ("retrieve-too-few-ids", lambda e, t, i: e.retrieve(e.chunk_keys(t), i[:3]), LayoutError, "cannot hold"),
    ("store-id-too-big", lambda e, t, i: e.store(e.chunk_keys(t), i[:-1] + [16]), LayoutError, "out of range"),
    ("retrieve-negative-id", lambda e, t, i: e.retrieve(e.chunk_keys(t), [-1] + i[1:]), LayoutError, "out of range"),
    ("store-float-id", lambda e, t, i: e.store(e.chunk_keys(t), i[:-1] + [1.0]), LayoutError, "out of range"),
    ("store-duplicate-ids", lambda e, t, i: e.store(e.chunk_keys(t), i[:-1] + i[:1]), LayoutError, "distinct"),
    ("retrieve-duplicate-ids", lambda e, t, i: e.retrieve(e.chunk_keys(t), i[:-1] + i[-2:-1]), LayoutError, "distinct"),
    ("retrieve-negative-skip", lambda e, t, i: e.retrieve(e.chunk_keys(t), i, skip_blocks=-1), LayoutError, "skip_blocks"),
    ("retrieve-negative-skip-with-count", lambda e, t, i: e.retrieve(e.chunk_keys(t), i, skip_blocks=-2, num_blocks=2), LayoutError, "skip_blocks"),
    ("retrieve-negative-count", lambda e, t, i: e.retrieve(e.chunk_keys(t), i, num_blocks=-1), LayoutError, "num_blocks"),
    ("lookup-negative-skip", lambda e, t, i: e.lookup(e.chunk_keys(t), skip_tokens=-8, lease="x"), LayoutError, "skip_tokens"),
    ("store-negative-token", lambda e, t, i: e.store(e.chunk_keys([-1] + t[1:]), i), LayoutError, r"2\*\*32"),
    ("lookup-huge-token", lambda e, t, i: e.lookup(e.chunk_keys(t[:-1] + [2**32]), lease="x"), LayoutError, r"2\*\*32"),
    ("retrieve-huge-token", lambda e, t, i: e.retrieve(e.chunk_keys([2**40] + t[1:]), i), LayoutError, r"2\*\*32"),
    ("register-3d", lambda e, t, i: e.register_pool(torch.zeros(16, 2, 32, dtype=torch.float16)), LayoutError, "4-D"),
    ("register-non-contiguous", lambda e, t, i: e.register_pool(torch.zeros(2, 16, 2, 16, dtype=torch.float16).transpose(0, 1)), LayoutError, "contiguous"),
    ("register-other-layers", lambda e, t, i: e.register_pool(torch.zeros(16, 3, 2, 16, dtype=torch.float16)), LayoutError, "geometry"),
    ("register-other-kv", lambda e, t, i: e.register_pool(torch.zeros(16, 2, 1, 16, dtype=torch.float16)), LayoutError, "geometry"),
    ("register-other-dtype", lambda e, t, i: e.register_pool(torch.zeros(16, 2, 2, 16, dtype=torch.bfloat16)), LayoutError, "bfloat16"),
    ("register-other-element-size", lambda e, t, i: e.register_pool(torch.zeros(16, 2, 2, 8, dtype=torch.float32)), LayoutError, "geometry"),
    ("register-bad-row", lambda e, t, i: e.register_pool(torch.zeros(16, 2, 2, 18, dtype=torch.float16)), LayoutError, "tokens_per_block"),
]


@pytest.mark.parametrize(("call", "error", "fragment"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_leaves_the_cache_unchanged(call, error, fragment):
    rig = Rig(tpb=4, bpc=2, layers=2, kv=2, row=4, num_blocks=16)  # pool [16, 2, 2, 16] fp16
    engine = rig.engine
    tokens, ids = rig.tokens(20), rig.ids(5)  # 2 full chunks + 4 tokens: 5 blocks
    original = rig.rows()
    engine.store(engine.chunk_keys(tokens[:8]), ids).wait()  # one chunk cached
    before = snapshot(rig, engine.chunk_keys(tokens))
    with pytest.raises(error, match=fragment):
        call(engine, tokens, ids)
    assert same(snapshot(rig, engine.chunk_keys(tokens)), before)
    # Still fully working, on the original pool.
    assert engine.store(engine.chunk_keys(tokens), ids).chunks == 1
    poison = rig.fill()
    assert engine.retrieve(engine.chunk_keys(tokens), ids) == 16
    verify_rows(rig.rows(), {ids[p]: original[ids[p]] for p in range(4)}, poison)
    engine.release("x")
    rig.verify_idle()


def test_construction_errors():
    pool = torch.zeros(8, 2, 2, 16, dtype=torch.float16)  # 4 tokens per block: 128 B blocks
    with pytest.raises(LayoutError, match=r"chunk_size=6 must be a multiple of .*tokens_per_block=4"):
        CacheEngine.for_pool(pool, 4, config=DepotConfig(chunk_size=6))
    layout = PoolLayout.from_pool(pool, 4, 8)
    with pytest.raises(ConfigError, match="chunk_size=16"):
        CacheEngine(layout, DepotConfig(chunk_size=16))
    tiny = DepotConfig(chunk_size=8, host_capacity_gb=255e-9)  # 255 bytes < one 256-byte chunk
    with pytest.raises(ConfigError) as err:
        CacheEngine(layout, tiny)
    assert "'host_capacity_gb'" in str(err.value) and "2.55e-07" in str(err.value) and "256 bytes" in str(err.value)
    engine = CacheEngine(layout, DepotConfig(chunk_size=8, host_capacity_gb=256e-9))
    assert engine.stats().host_capacity_chunks == 1
    with pytest.raises(LayoutError, match="register_pool"):
        engine.store(engine.chunk_keys(list(range(8))), [0, 1])
    with pytest.raises(LayoutError, match="register_pool"):
        engine.retrieve(engine.chunk_keys(list(range(8))), [0, 1])


# ---- threads -----------------------------------------------------------------------------------


def test_threads_with_disjoint_blocks_get_exact_bytes_and_consistent_counters():
    threads, rounds, per = 4, 6, 6  # each round: 3 chunks of 2 blocks
    rig = Rig(tpb=2, bpc=2, num_blocks=threads * per, capacity_chunks=threads * rounds * 3)
    engine, errors = rig.engine, []

    def worker(t: int) -> None:
        gen = torch.Generator().manual_seed(1000 + t)
        own = list(range(t * per, (t + 1) * per))
        rows = rig.pool.view(torch.uint8).reshape(rig.num_blocks, -1)
        try:
            for r in range(rounds):
                ids = [own[i] for i in torch.randperm(per, generator=gen).tolist()]
                tokens = [t, r] + torch.randint(0, 2**32, (10,), generator=gen).tolist()  # 12: 3 chunks
                data = torch.randint(0, 256, (per, rows.shape[1]), dtype=torch.uint8, generator=gen)
                rows[own] = data
                assert engine.store(engine.chunk_keys(tokens), ids).chunks == 3
                assert engine.lookup(engine.chunk_keys(tokens), lease=(t, r)) == 12
                rows[own] = 0
                assert engine.retrieve(engine.chunk_keys(tokens), ids, lease=(t, r)) == 12
                assert torch.equal(rows[own], data)
        except Exception as exc:  # reported below, with the thread's failure
            errors.append((t, exc))

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=60)
    assert not errors, errors
    stats = engine.stats()
    total = threads * rounds * 3
    assert (stats.stored_chunks, stats.loaded_chunks, stats.hits, stats.host_chunks) == (total, total, total, total)
    assert (stats.lookups, stats.misses, stats.evictions, stats.dropped_stores) == (threads * rounds, 0, 0, 0)
    assert stats.bytes_stored == stats.bytes_loaded == total * rig.chunk_bytes
    rig.verify_idle()


# ---- CUDA --------------------------------------------------------------------------------------


class SlowMover(transfer.base.PerChunk):
    """A real mover that first keeps the stream it runs on busy (a GPU sleep), so tests can
    see which streams wait for a transfer and which do not."""

    CYCLES = 1_000_000_000  # ~0.5 s at 1.98 GHz, longer at lower clocks

    def __init__(self, slow_gather: bool = False, slow_scatter: bool = False) -> None:
        self.inner = transfer.TorchBlockMover()
        self.slow_gather, self.slow_scatter = slow_gather, slow_scatter

    def gather(self, views, block_ids, dst, first=0):
        if self.slow_gather:
            torch.cuda._sleep(self.CYCLES)
        self.inner.gather(views, block_ids, dst, first)

    def scatter(self, src, views, block_ids, first=0):
        if self.slow_scatter:
            torch.cuda._sleep(self.CYCLES)
        self.inner.scatter(src, views, block_ids, first)


def cuda_engine(rig: Rig, mover) -> CacheEngine:
    """An engine on the rig's pool with ``mover``; it replaces the rig's (``verify_idle`` checks it)."""
    engine = CacheEngine(PoolLayout.from_pool(rig.pool, rig.tpb, rig.chunk), rig.config, mover=mover)
    engine.register_pool(rig.pool)
    rig.engine.close()
    rig.engine = engine
    return engine


def forward_stream(engine: CacheEngine) -> torch.cuda.Stream:
    """A new stream that is not one of the engine's (torch pools streams: see the xfail below)."""
    while True:
        stream = torch.cuda.Stream()
        if stream not in engine._streams:
            return stream


@pytest.mark.gpu
@pytest.mark.parametrize("mover", sorted(MOVERS))
@settings(max_examples=40, deadline=None)
@given(s=scenarios())
def test_cuda_store_then_retrieve_is_bit_exact(mover, s):
    round_trip(s, device="cuda", mover=mover)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_odd_blocks_every_dtype_and_many_async_stores(dtype):
    rig = Rig(device="cuda", dtype=dtype, tpb=16, bpc=3, layers=5, kv=2, row=24, num_blocks=61, seed=7)
    engine = rig.engine
    assert engine.host.pin_memory  # auto: pinned when CUDA is present
    engine.wait_arena()
    assert engine.stats().host_pending_chunks == 0 < engine.stats().host_capacity_chunks
    original = rig.rows()
    requests = []
    for n_ids in (1, 3, 7, 13):  # odd counts, random order, partial trailing chunk
        ids = rig.ids(n_ids)
        tokens = rig.tokens(n_ids * 16 - 5)
        requests.append((tokens, ids, engine.store(engine.chunk_keys(tokens), ids)))
    engine.wait_all()
    assert all(h.done() for _, _, h in requests)
    assert engine.stats().inflight_transfers == 0
    poison = rig.fill()
    expected = {}
    for tokens, ids, handle in requests:
        chunks = len(tokens) // rig.chunk
        assert handle.chunks == chunks and engine.lookup(engine.chunk_keys(tokens)) == chunks * rig.chunk
        got = engine.retrieve(engine.chunk_keys(tokens), ids, skip_blocks=1)
        assert got == (chunks * 3 if chunks else 1) * 16
        expected.update({ids[p]: original[ids[p]] for p in range(1, chunks * 3)})
    verify_rows(rig.rows(), expected, poison)  # read on the current stream, which waited for the loads
    engine.poll()
    rig.verify_idle()


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["default", "own"])
def test_cuda_store_does_not_make_the_callers_stream_wait(forward):
    rig = Rig(device="cuda", tpb=16, bpc=2, num_blocks=8)
    engine = cuda_engine(rig, SlowMover(slow_gather=True))
    tokens, ids = rig.tokens(64), [6, 1, 3, 0]
    original = rig.rows()
    caller = torch.cuda.current_stream() if forward == "default" else forward_stream(engine)
    with torch.cuda.stream(caller):
        handle = engine.store(engine.chunk_keys(tokens), ids)
        caller_done = torch.cuda.Event()
        caller_done.record(caller)
    caller_done.synchronize()
    assert not handle.done()  # the caller's stream finished while the store is still copying
    assert engine.lookup(engine.chunk_keys(tokens)) == 0  # a chunk being written is not visible yet
    handle.wait()
    assert handle.done() and engine.lookup(engine.chunk_keys(tokens)) == 64
    poison = rig.fill()
    assert engine.retrieve(engine.chunk_keys(tokens), ids) == 64
    verify_rows(rig.rows(), {b: original[b] for b in ids}, poison)
    rig.verify_idle()


class GatedMover(transfer.base.PerChunk):
    """Gathers only once ``gate`` opens (or raise ``error``); records which thread issued them."""

    def __init__(self, error: Exception | None = None) -> None:
        self.inner, self.gate, self.error, self.threads = transfer.TorchBlockMover(), threading.Event(), error, []

    def gather(self, views, block_ids, dst, first=0):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(30)
        if self.error is not None:
            raise self.error
        self.inner.gather(views, block_ids, dst, first)

    def scatter(self, src, views, block_ids, first=0):
        self.inner.scatter(src, views, block_ids, first)


def close_and_check_the_issuer_stops(engine: CacheEngine) -> None:
    issuer = engine._transfers._issuer  # white box: the thread this engine started
    engine.close()
    assert issuer is not None and not issuer.is_alive()


@pytest.mark.gpu
def test_cuda_store_is_issued_off_the_callers_thread_and_a_load_does_not_wait_for_it():
    """The engine's step loop only books a store: its copies are issued by the issuer thread, so
    a load issued next (the next step's) runs while the store has not even been issued."""
    rig = Rig(device="cuda", tpb=16, bpc=2, num_blocks=12)
    mover = GatedMover()
    engine = cuda_engine(rig, mover)
    first, first_ids = rig.tokens(64), [7, 2, 9, 4]
    mover.gate.set()
    engine.store(engine.chunk_keys(first), first_ids).wait()  # maybe issued by this thread, waiting for it
    original = rig.rows()
    mover.gate.clear()
    mover.threads.clear()
    second, second_ids = rig.tokens(64), [0, 11, 5, 3]
    handle = engine.store(engine.chunk_keys(second), second_ids)  # returns while its gather waits at the gate
    deadline = time.monotonic() + 30
    while not mover.threads:  # the issuer took it (else the wait below would: whoever waits first issues)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not handle.done() and engine.lookup(engine.chunk_keys(second)) == 0
    poison = rig.fill(first_ids)
    assert engine.lookup(engine.chunk_keys(first)) == 64 and engine.retrieve(engine.chunk_keys(first), first_ids) == 64
    verify_rows(rig.rows(), {b: original[b] for b in first_ids}, poison)
    assert not handle.done()  # the load completed while the store still waited to be issued
    mover.gate.set()
    handle.wait()
    assert engine.lookup(engine.chunk_keys(second)) == 64 and set(mover.threads) == {"kvdepot-store-issuer"}
    poison = rig.fill(second_ids)
    assert engine.retrieve(engine.chunk_keys(second), second_ids) == 64
    verify_rows(rig.rows(), {b: original[b] for b in second_ids}, poison)
    rig.verify_idle()
    close_and_check_the_issuer_stops(engine)


@pytest.mark.gpu
def test_cuda_store_that_cannot_be_issued_is_dropped_and_leaks_nothing():
    rig = Rig(device="cuda", tpb=16, bpc=2, num_blocks=8)
    mover = GatedMover(error=RuntimeError("no copy today"))
    engine = cuda_engine(rig, mover)
    tokens, ids = rig.tokens(64), [6, 1, 3, 0]
    mover.gate.set()
    handle = engine.store(engine.chunk_keys(tokens), ids)
    handle.wait()
    assert handle.done() and engine.lookup(engine.chunk_keys(tokens)) == 0
    stats = engine.stats()
    assert (stats.inflight_transfers, stats.host_chunks) == (0, 0)
    mover.error = None
    engine.store(engine.chunk_keys(tokens), ids).wait()
    assert engine.lookup(engine.chunk_keys(tokens)) == 64
    close_and_check_the_issuer_stops(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("mover", ["slow", "batch"])
@pytest.mark.parametrize("explicit_stream", [False, True])
def test_cuda_store_waits_for_the_callers_writes_and_the_caller_waits_for_loads(explicit_stream, mover):
    """``slow``: a load that keeps its stream busy, which the caller's stream must wait for.
    ``batch``: a store whose first copies the calling thread enqueues itself (its issuer idle),
    which must still come after the caller's writes (the store's stream waits for the caller's)."""
    if mover == "batch" and not transfer.cuda_batch.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync_v2")
    rig = Rig(device="cuda", dtype=torch.bfloat16, tpb=8, bpc=2, num_blocks=10)
    engine = cuda_engine(rig, SlowMover(slow_scatter=True) if mover == "slow" else transfer.BatchBlockMover())
    tokens, ids = rig.tokens(32), [9, 2, 4, 5]
    rows = rig.pool.view(torch.uint8).reshape(rig.num_blocks, -1)
    fresh = rig.random(len(ids), rows.shape[1]).cuda()
    index = torch.tensor(ids, device="cuda")
    engine.store(engine.chunk_keys(rig.tokens(16)), [0, 1]).wait()  # warm up: the arena is allocated before the timed part
    # A non-default forward stream, as TensorRT-LLM runs on; passed explicitly or only current.
    forward = forward_stream(engine)
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        # A long "forward pass" that then writes the KV, all enqueued without the host waiting
        # (no host->device copy from pageable memory here: that would block until the sleep ends).
        torch.cuda._sleep(SlowMover.CYCLES)
        rows.index_copy_(0, index, fresh)
        handle = engine.store(engine.chunk_keys(tokens), ids, stream=forward if explicit_stream else None)
        assert not handle.done()
    handle.wait()
    poison = rig.fill()
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        got = engine.retrieve(engine.chunk_keys(tokens), ids, stream=forward if explicit_stream else None)
        after = rows.clone()  # enqueued behind the (slow) load only if the stream waits for it
    forward.synchronize()
    assert got == 32
    verify_rows(after.cpu(), dict(zip(ids, fresh.cpu(), strict=True)), poison)
    engine.wait_all()
    rig.verify_idle()


@pytest.mark.gpu
def test_cuda_side_streams_are_never_a_callers_stream():
    """torch hands pool streams out round robin, so a caller's torch.cuda.Stream() can be one of the
    engine's (seen on an H200: draws 30, 31, 62, 63 aliased); the engine must then use another."""
    rig = Rig(device="cuda", tpb=16, bpc=2, num_blocks=8)
    callers = [torch.cuda.Stream() for _ in range(96)] + list(rig.engine._streams)  # white box
    for store in (True, False):
        assert not [c for c in callers if rig.engine._side_stream(store, c) == c]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_load_by_layer_is_bit_exact_and_each_layer_is_ready_at_its_event(dtype):
    """``retrieve_by_layer`` on a cross-layer pool with 64 KiB per layer and block: the caller's
    stream is not made to wait; a read of layer ``l`` enqueued after ``wait_layer(l)`` sees the
    stored bytes; after every layer the loaded blocks hold exactly what was stored and no other
    block changed. Random bytes each run, odd block ids, a load that starts inside a chunk."""
    elem = torch.empty(0, dtype=dtype).element_size()
    rig = Rig(device="cuda", dtype=dtype, tpb=16, bpc=3, layers=5, kv=2, row=(64 << 10) // (2 * 16 * elem),
              num_blocks=29, mover="batch", seed=int(torch.randint(0, 2**31, ())))
    engine = rig.engine
    assert engine.can_load_by_layer()
    tokens, ids = rig.tokens(7 * 16), rig.ids(7)
    original = rig.rows()
    engine.store(engine.chunk_keys(tokens), ids).wait()
    poison = rig.fill()
    load_ids = rig.ids(7)
    forward = forward_stream(engine)
    layers = rig.pool.view(torch.uint8)  # [block, layer, k|v, bytes]
    seen = []
    with torch.cuda.stream(forward):
        assert engine.lookup(engine.chunk_keys(tokens)) == 96
        got, load = engine.retrieve_by_layer(engine.chunk_keys(tokens), load_ids, skip_blocks=1)
        assert got == 96 and load is not None and len(load.events) == 5
        assert load.issued == min(5, LAYERS_AHEAD)  # the rest is enqueued as the forward waits
        for layer in range(5):
            load.wait_layer(layer, forward)
            seen.append(layers[load_ids[1:6], layer].clone())  # what layer ``layer``'s attention would read
    forward.synchronize()
    assert load.fully_waited and engine.stats().layered_loads == 1
    expected = {load_ids[p]: original[ids[p]] for p in range(1, 6)}
    verify_rows(rig.rows(), expected, poison)
    per_layer = original.view(29, 5, -1)
    for layer, snapshot in enumerate(seen):
        assert torch.equal(snapshot.reshape(5, -1).cpu(), per_layer[ids[1:6], layer]), f"layer {layer}"
    engine.poll()
    rig.verify_idle()


@pytest.mark.gpu
@pytest.mark.parametrize("waiter", ["wait_all", "store_wait"])
def test_cuda_layered_load_nobody_waits_for_is_enqueued_by_the_next_wait(waiter):
    """A layered load whose forward never comes: ``engine.wait_all`` — or a later store's
    ``wait``, which completes behind it — enqueues its remaining layers instead of waiting
    forever for copies nobody would enqueue; the blocks then hold exactly the stored bytes."""
    elem = torch.empty(0, dtype=torch.bfloat16).element_size()
    layers = LAYERS_AHEAD + 3
    rig = Rig(device="cuda", tpb=16, bpc=2, layers=layers, kv=2, row=(64 << 10) // (2 * 16 * elem),
              num_blocks=24, mover="batch", seed=int(torch.randint(0, 2**31, ())))
    engine = rig.engine
    tokens, ids = rig.tokens(4 * 16), rig.ids(4)
    original = rig.rows()
    engine.store(engine.chunk_keys(tokens), ids).wait()
    poison = rig.fill()
    load_ids = rig.ids(4)
    got, load = engine.retrieve_by_layer(engine.chunk_keys(tokens), load_ids)
    assert got == 64 and load is not None and load.issued == LAYERS_AHEAD
    if waiter == "wait_all":
        engine.wait_all()
    else:
        engine.store(engine.chunk_keys(rig.tokens(2 * 16)), [b for b in range(24) if b not in load_ids][:2]).wait()
    assert load.fully_issued
    torch.cuda.synchronize()
    verify_rows(rig.rows(), {load_ids[p]: original[ids[p]] for p in range(4)}, poison)  # a store only reads the pool
    engine.poll()
    rig.verify_idle()


@pytest.mark.gpu
def test_cuda_load_by_layer_falls_back_to_a_whole_load_for_small_layer_parts():
    rig = Rig(device="cuda", tpb=16, bpc=2, layers=4, num_blocks=12, mover="batch")  # 128 B per layer and block
    engine = rig.engine
    assert not engine.can_load_by_layer()
    tokens, ids = rig.tokens(64), rig.ids(4)
    original = rig.rows()
    engine.store(engine.chunk_keys(tokens), ids).wait()
    poison = rig.fill()
    load_ids = rig.ids(4)
    got, load = engine.retrieve_by_layer(engine.chunk_keys(tokens), load_ids)
    assert got == 64 and load is None  # whole: the current stream waits for it, as after retrieve
    verify_rows(rig.rows(), {load_ids[p]: original[ids[p]] for p in range(4)}, poison)
    engine.poll()
    rig.verify_idle()
