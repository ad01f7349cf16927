"""``kvdepot.transfer.plan``: the batch mover's copy lists, executed on the CPU (they are address
arithmetic): exactly the bytes the reference mover moves, one copy per maximal run, never a run
across two allocations, and a plan that goes with its pool. Where the C helper is built
(``native.NATIVE``), ``head_list`` and one-view ``copy_list`` are its lists: the tests here run
on them, and ``test_native.py`` checks them equal to the Python ones."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import HostDriver, cases, make_pool, random_bytes

from kvdepot.transfer import BatchBlockMover, TorchBlockMover
from kvdepot.transfer.base import ChunkCopy, host_span
from kvdepot.transfer.plan import (
    PoolViews,
    block_addresses,
    copy_list,
    head_list,
    make_plan,
    plan_of,
)


def _execute(listing) -> None:
    """What the driver does with a copy list, done by the CPU on CPU addresses."""
    for d, s_, n in zip(listing.dst.tolist(), listing.src.tolist(), listing.sizes.tolist(), strict=True):
        ctypes.memmove(d, s_, n)


def _chunked(ids, data, per_block, gen, adjacent: bool):
    """Split ids into chunks of random sizes at random first positions; ``adjacent``: the chunks'
    buffers are back-to-back slices of one arena (so runs may cross chunk boundaries), cut at
    random chunk boundaries into separate allocations that still lie back to back (pinned arena
    segments do), across which no run may go. Each chunk's addresses are given with it (``span``,
    as the host tier gives them) or not, at random."""
    sizes = []
    while len(ids) > sum(sizes):
        sizes.append(data.draw(st.integers(1, len(ids) - sum(sizes))))
    firsts = [0 if adjacent else data.draw(st.integers(0, 2)) for _ in sizes]
    lengths = [f + n + (0 if adjacent else data.draw(st.integers(0, 1))) for f, n in zip(firsts, sizes, strict=True)]
    memory = random_bytes((sum(lengths) * per_block,), gen).numpy()
    cuts = {0} | {i for i in range(1, len(sizes)) if adjacent and data.draw(st.booleans())}
    copies, at, used, owner = [], 0, 0, None
    for k, (n, first, length) in enumerate(zip(sizes, firsts, lengths, strict=True)):
        if k in cuts:  # a new allocation from here to the next cut
            end = next((i for i in sorted(cuts) if i > k), len(sizes))
            owner, owner_at = torch.from_numpy(memory[at * per_block : (at + sum(lengths[k:end])) * per_block]), at
        host = owner[(at - owner_at) * per_block : (at - owner_at + length) * per_block]
        span = host_span(host) if data.draw(st.booleans()) else None  # given (the host tier's) or asked
        copies.append(ChunkCopy(ids[used : used + n], host, first, span))
        at, used = at + length, used + n
    return copies


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@settings(max_examples=120, deadline=None)
@given(c=cases(), data=st.data())
def test_copy_list_moves_exactly_what_the_reference_mover_moves(c, data):
    """Executed on the CPU, a copy list must do what the per-run mover does (the same host bytes
    after a store, the same pool bytes after a load into poison) with one copy per maximal run of
    blocks adjacent in both the pool and the host buffers, never one across two allocations."""
    pool, views, gen = make_pool(c, "cpu")
    if data.draw(st.booleans()):  # consecutive ids in some chunks, so runs exist to merge
        c["ids"] = sorted(c["ids"])
    per_block = sum(v.shape[1] for v in views)
    copies = _chunked(c["ids"], data, per_block, gen, adjacent=data.draw(st.booleans()))
    reference = [ChunkCopy(cp.block_ids, cp.host.clone(), cp.first) for cp in copies]
    TorchBlockMover().gather_many(views, reference)
    plan = make_plan(views)
    store = copy_list(plan, copies, to_host=True)
    host_at, pool_at, sizes = store.dst, store.src, store.sizes
    assert sizes.sum() == len(c["ids"]) * per_block
    allocations = [(cp.host.data_ptr(), _storage(cp.host), cp.host.numel()) for cp in copies]
    for k in range(len(sizes)):
        if k + 1 < len(sizes):  # maximal: no copy continues where the one before it ended
            assert not (pool_at[k] + sizes[k] == pool_at[k + 1] and host_at[k] + sizes[k] == host_at[k + 1]
                        and _allocation(allocations, host_at[k]) == _allocation(allocations, host_at[k + 1]))
        # within one allocation on the host side: its first and last byte in the same one
        assert _allocation(allocations, host_at[k]) == _allocation(allocations, host_at[k] + sizes[k] - 1)
    _execute(store)
    for ours, theirs in zip(copies, reference, strict=True):
        assert torch.equal(ours.host, theirs.host)
    raw = pool.view(torch.uint8)
    poison = random_bytes(raw.shape, gen)
    raw.copy_(poison)
    load = copy_list(plan, copies, to_host=False)
    assert np.array_equal(load.dst, store.src) and np.array_equal(load.src, store.dst)
    _execute(load)
    ours = raw.clone()
    raw.copy_(poison)
    TorchBlockMover().scatter_many(reference, views)
    assert torch.equal(ours, raw)


def _per_block(listing, per_block: int) -> list[tuple[int, int]]:
    """Each block-sized (destination, source) pair a list's copies cover."""
    return [(d + k, s_ + k) for d, s_, n in zip(listing.dst.tolist(), listing.src.tolist(), listing.sizes.tolist(),
                                                strict=True) for k in range(0, n, per_block)]


@settings(max_examples=120, deadline=None)
@given(c=cases(), data=st.data())
def test_an_early_list_and_the_rest_cover_what_copy_list_covers(c, data):
    """``head_list`` (plain Python) then ``copy_list`` of what it leaves: the same block pairs as
    ``copy_list`` of the whole move, in order, within the early list's bounds, its copies merged
    as ``copy_list`` merges them (one copy at most cut in two where it stops), and executed they
    store and load exactly what the reference mover does."""
    c = {**c, "per_layer": False}  # one view: TensorRT-LLM's cross-layer pool
    pool, views, gen = make_pool(c, "cpu")
    if data.draw(st.booleans()):
        c["ids"] = sorted(c["ids"])
    per_block = views[0].shape[1]
    copies = _chunked(c["ids"], data, per_block, gen, adjacent=data.draw(st.booleans()))
    reference = [ChunkCopy(cp.block_ids, cp.host.clone(), cp.first) for cp in copies]
    TorchBlockMover().gather_many(views, reference)
    plan = make_plan(views)
    max_bytes = data.draw(st.integers(1, len(c["ids"]) + 1)) * per_block - data.draw(st.integers(0, per_block - 1))
    max_copies = data.draw(st.integers(1, 6))
    for to_host in (True, False):
        early, taken, rest = head_list(plan, copies, to_host=to_host, max_bytes=max_bytes, max_copies=max_copies)
        whole, tail = copy_list(plan, copies, to_host=to_host), copy_list(plan, rest, to_host=to_host)
        assert _per_block(early, per_block) + _per_block(tail, per_block) == _per_block(whole, per_block)
        assert early.count <= max_copies and early.count + tail.count - whole.count in (0, 1)
        assert taken == int(early.sizes.sum()) and taken < max_bytes + per_block and (taken >= max_bytes or early.count == max_copies or not rest)
        assert whole.count == 0 or early.count >= 1
        if to_host:
            _execute(early)
            _execute(tail)
            for ours, theirs in zip(copies, reference, strict=True):
                assert torch.equal(ours.host, theirs.host)
        else:
            raw = pool.view(torch.uint8)
            poison = random_bytes(raw.shape, gen)
            raw.copy_(poison)
            _execute(early)
            _execute(tail)
            ours = raw.clone()
            raw.copy_(poison)
            TorchBlockMover().scatter_many(reference, views)
            assert torch.equal(ours, raw)


def _allocation(allocations, address: int) -> int:
    """The storage a host address lies in (chunks' buffers: start, storage, bytes)."""
    return next(storage for start, storage, size in allocations if start <= address < start + size)


def test_copy_list_merges_blocks_adjacent_on_both_sides_across_chunks():
    pool = torch.zeros(10, 8, dtype=torch.uint8)
    arena = torch.zeros(6 * 8, dtype=torch.uint8)
    copies = [ChunkCopy([2, 3], arena[:16]), ChunkCopy([4, 7], arena[16:32]), ChunkCopy([8], arena[40:48])]
    listing = copy_list(make_plan([pool]), copies, to_host=True)
    base, host = pool.data_ptr(), arena.data_ptr()
    # 2,3,4 are one span on both sides; 7 and 8 are adjacent in the pool but not in the arena
    assert list(zip(listing.src.tolist(), listing.dst.tolist(), listing.sizes.tolist(), strict=True)) == [
        (base + 16, host, 24), (base + 56, host + 24, 8), (base + 64, host + 40, 8)]
    assert listing.ends.tolist() == [24, 32, 40]


@pytest.mark.parametrize("views", [1, 2])
def test_copy_list_never_joins_two_allocations_that_lie_back_to_back(views):
    """Two pinned arena segments can sit next to each other in the address space; one copy
    spanning both is refused by the driver (CUDA_ERROR_INVALID_VALUE) and the store is lost."""
    pool = torch.zeros(10, 8, dtype=torch.uint8)
    pool_views = [pool] if views == 1 else [pool[:, :4], pool[:, 4:]]
    memory = np.zeros(32, dtype=np.uint8)
    first, second = torch.from_numpy(memory[:16]), torch.from_numpy(memory[16:])  # two storages, adjacent
    assert first.data_ptr() + 16 == second.data_ptr() and _storage(first) != _storage(second)
    plan = make_plan(pool_views)
    apart = copy_list(plan, [ChunkCopy([2, 3], first), ChunkCopy([4, 5], second)], to_host=True)
    one = torch.from_numpy(memory)  # the same bytes as one allocation
    joined = copy_list(plan, [ChunkCopy([2, 3], one[:16]), ChunkCopy([4, 5], one[16:])], to_host=True)
    if views == 1:
        assert apart.sizes.tolist() == [16, 16] and apart.dst.tolist() == [first.data_ptr(), second.data_ptr()]
        assert joined.sizes.tolist() == [32]
    else:  # view-major slots, rows 8 bytes apart: one copy per block and view, each in one storage
        assert apart.sizes.tolist() == joined.sizes.tolist() == [4] * 8
        ends = (apart.dst + apart.sizes - 1).tolist()
        assert [d < second.data_ptr() for d in apart.dst.tolist()] == [e < second.data_ptr() for e in ends]


def test_views_that_are_not_plain_bytes_have_no_plan_and_move_by_torch():
    """Address arithmetic needs rows of contiguous bytes; anything else (a view of another dtype,
    rows with gaps) is moved by the fallback, still exactly."""
    pool = torch.arange(6 * 8, dtype=torch.int16).view(6, 8)
    assert make_plan([pool]) is None  # 2-byte elements
    raw = pool.view(torch.uint8)
    gappy = raw[:, ::2]  # every other byte of a row
    assert make_plan([gappy]) is None and make_plan([]) is None and make_plan([raw]) is not None
    driver = HostDriver()
    host = torch.zeros(2 * 8, dtype=torch.uint8)
    BatchBlockMover(driver=driver).gather([gappy], [4, 1], host)
    assert driver.calls == [] and torch.equal(host.view(2, 8), gappy[[4, 1]])


def test_block_addresses_are_each_listed_blocks_in_order():
    pool = torch.zeros(10, 8, dtype=torch.uint8)
    arena = torch.zeros(8 * 8, dtype=torch.uint8)
    copies = [ChunkCopy([5, 6], arena[:24], first=1), ChunkCopy([], arena[24:40]), ChunkCopy([0], arena[40:])]
    pool_at, host_at = block_addresses(make_plan([pool]), copies)
    base, host = pool.data_ptr(), arena.data_ptr()
    assert pool_at.tolist() == [base + 40, base + 48, base] and host_at.tolist() == [host + 8, host + 16, host + 40]


def test_an_engine_makes_a_new_plan_when_a_pool_is_registered_again():
    """A plan holds the pool's addresses: registering another pool (a model reload) must not
    leave copies aimed at the old one. Stores and loads after the swap move the new pool's bytes
    (the batch mover on a CPU pool, through the host-memory driver)."""
    from kvdepot.config import load_config
    from kvdepot.engine import CacheEngine
    from kvdepot.layout import PoolLayout

    gen = torch.Generator().manual_seed(3)
    pools = [random_bytes((12, 2, 2, 32), gen).view(torch.float16) for _ in range(2)]
    layout = PoolLayout.from_pool(pools[0], 4, 8)
    driver = HostDriver()
    engine = CacheEngine(layout, load_config(chunk_size=8, host_capacity_gb=1e-3, pin_host_memory="false"),
                         mover=BatchBlockMover(driver=driver))
    engine.register_pool(pools[0])
    first_plan = plan_of(engine._views)  # white box: the registered views carry their plan
    assert isinstance(engine._views, PoolViews) and plan_of(engine._views) is first_plan
    engine.register_pool(pools[1])
    assert plan_of(engine._views) is not first_plan and int(plan_of(engine._views).base[0]) == pools[1].data_ptr()
    keys = engine.chunk_keys(list(range(16)))
    engine.store(keys, [7, 2, 9, 4]).wait()
    new = pools[1].data_ptr(), pools[1].data_ptr() + pools[1].numel() * pools[1].element_size()
    assert driver.calls and all(new[0] <= s < new[1] for c in driver.calls for s in c["src"])  # not the old pool
    expected = pools[1].view(torch.uint8)[[7, 2, 9, 4]].clone()
    pools[1].view(torch.uint8).zero_()
    assert engine.retrieve(keys, [7, 2, 9, 4]) == 16
    assert torch.equal(pools[1].view(torch.uint8)[[7, 2, 9, 4]], expected)
    engine.close()
