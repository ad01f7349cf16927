"""``kvdepot.transfer``: ``block_runs`` and every mover's gather/scatter, byte for byte (the batch
mover's copy lists and windows: ``test_plan.py``, ``test_batch.py``).

Every test fills the source with fresh random bytes and the destination with a *different*
random pattern (poison), then checks the listed blocks landed and every other byte kept its
poison. The same property runs on CPU and, marked ``gpu``, on CUDA pools with pinned host
buffers and a side stream.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import DTYPES, cases, host_buffer, make_pool, random_bytes, regions, run_on_side_stream

from kvdepot.transfer import MOVERS, block_runs
from kvdepot.transfer.base import view_regions

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Every mover on CUDA; on CPU they all fall back to the per-run copies, tested once.
DEVICE_MOVERS = [("cpu", "runs")] + [pytest.param("cuda", name, marks=pytest.mark.gpu) for name in sorted(MOVERS)]


# ---- block_runs ----------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), unique=True, max_size=25))
def test_block_runs_are_maximal_runs_that_rebuild_the_list(ids):
    runs = block_runs(ids)
    rebuilt = [first + k for _, first, length in runs for k in range(length)]
    assert rebuilt == ids
    assert [pos for pos, _, _ in runs] == [sum(r[2] for r in runs[:i]) for i in range(len(runs))]
    assert all(length >= 1 for _, _, length in runs)
    for (_, first, length), (_, nxt, _) in zip(runs, runs[1:], strict=False):
        assert first + length != nxt  # adjacent runs could not have been merged


def test_block_runs_examples():
    assert block_runs([]) == []
    assert block_runs([5]) == [(0, 5, 1)]
    assert block_runs([3, 4, 5, 9, 10, 2, 1]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 1, 1)]


def test_view_regions_split_a_host_buffer_view_major():
    views = [torch.zeros(6, 3, dtype=torch.uint8), torch.zeros(6, 5, dtype=torch.uint8)]
    buf = torch.arange(2 * 8, dtype=torch.uint8)  # room for 2 blocks
    (v0, r0), (v1, r1) = view_regions(views, buf)
    assert v0 is views[0] and v1 is views[1]
    assert r0.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert r1.tolist() == [[6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]


# ---- gather / scatter ----------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "mover"), DEVICE_MOVERS)
@settings(max_examples=60, deadline=None)
@given(c=cases())
def test_gather_copies_exactly_the_listed_blocks_into_the_host_buffer(device, mover, c):
    pool, views, gen = make_pool(c, device)
    pool_before = pool.view(torch.uint8).cpu().clone()
    block_bytes = sum(v.shape[1] for v in views)
    n, first = len(c["ids"]), c["first"]
    dst = host_buffer(first + n + c["spare"], block_bytes, gen, device)
    poison = regions(views, dst)
    run_on_side_stream(device, lambda: MOVERS[mover]().gather(views, c["ids"], dst, first))
    after = regions(views, dst)
    for view, before, region in zip(views, poison, after, strict=True):
        expected = before.clone()
        for i, b in enumerate(c["ids"]):
            expected[first + i] = view[b].cpu()
        assert torch.equal(region, expected)  # listed blocks in list order, poison elsewhere
    assert torch.equal(pool.view(torch.uint8).cpu(), pool_before)  # a gather never writes the pool


@pytest.mark.parametrize(("device", "mover"), DEVICE_MOVERS)
@settings(max_examples=60, deadline=None)
@given(c=cases())
def test_scatter_writes_exactly_the_listed_blocks_and_round_trips(device, mover, c):
    pool, views, gen = make_pool(c, device)
    original = pool.view(torch.uint8).cpu().clone()
    block_bytes = sum(v.shape[1] for v in views)
    n, first = len(c["ids"]), c["first"]
    buf = host_buffer(first + n + c["spare"], block_bytes, gen, device)
    run_on_side_stream(device, lambda: MOVERS[mover]().gather(views, c["ids"], buf, first))
    buf_after_gather = buf.clone()
    # Poison the whole pool, then load the blocks back from the host buffer.
    poison = random_bytes(pool.view(torch.uint8).shape, gen)
    pool.view(torch.uint8).copy_(poison.to(device))
    run_on_side_stream(device, lambda: MOVERS[mover]().scatter(buf, views, c["ids"], first))
    now = pool.view(torch.uint8).cpu()  # checked through the pool itself, not the views
    listed = set(c["ids"])
    for b in range(c["num_blocks"]):
        assert torch.equal(now[b], original[b] if b in listed else poison[b]), b
    assert torch.equal(buf, buf_after_gather)  # a scatter never writes the host buffer


@pytest.mark.parametrize(("device", "mover"), DEVICE_MOVERS)
def test_empty_block_lists_move_nothing(device, mover):
    c = dict(num_blocks=3, layers=1, kv=2, elems=4, dtype=torch.float16, per_layer=False, seed=1)
    pool, views, gen = make_pool(c, device)
    before = pool.view(torch.uint8).cpu().clone()
    buf = host_buffer(1, views[0].shape[1], gen, device)
    buf_before = buf.clone()
    MOVERS[mover]().gather(views, [], buf)
    MOVERS[mover]().scatter(buf, views, [])
    MOVERS[mover]().gather_many(views, [])
    MOVERS[mover]().scatter_many([], views)
    assert torch.equal(pool.view(torch.uint8).cpu(), before) and torch.equal(buf, buf_before)


# ---- many chunks on two streams at once (GPU) ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mover_name", ["staged", "batch"])
@pytest.mark.parametrize("per_layer", [False, True, "uneven"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_chunks_round_trip_on_two_streams_at_once(mover_name, per_layer, dtype):
    """Staged: windows far smaller than the batch, so every window of both lanes is reused many
    times while the previous copy may still run. Batch: many driver calls, growing from one block
    to eight, on two streams at once. Stores and loads stay bit-exact either way."""
    from kvdepot.transfer import BatchBlockMover, StagedBlockMover
    from kvdepot.transfer.base import ChunkCopy

    c = dict(num_blocks=97, layers=3, kv=2, elems=40, dtype=dtype, per_layer=per_layer, seed=11)
    pool, views, gen = make_pool(c, "cuda")
    original = pool.view(torch.uint8).cpu().clone()
    block_bytes = sum(v.shape[1] for v in views)
    # Staged: 1-3 blocks per window (>= 1 chunk): many windows, many launches. Batch: windows of
    # 1, 2, 4, then 8 blocks' bytes (a copy ends the window its last byte falls in).
    if mover_name == "staged":
        mover = StagedBlockMover(window_bytes=3 * block_bytes)
    else:
        mover = BatchBlockMover(window_bytes=8 * block_bytes, first_window_bytes=block_bytes)
    ids = torch.randperm(97, generator=gen).tolist()
    sizes = [1, 3, 2, 5, 1, 4, 2, 3, 7, 1]  # odd chunk sizes; some exceed a window on their own
    chunks, at = [], 0
    for n in sizes:
        first = int(torch.randint(0, 2, (), generator=gen))
        host = host_buffer(first + n + 1, block_bytes, gen, "cuda")
        chunks.append(ChunkCopy(ids[at : at + n], host, first))
        at += n
    poison = [regions(views, cp.host) for cp in chunks]
    run_on_side_stream("cuda", lambda: mover.gather_many(views, chunks))
    for cp, before in zip(chunks, poison, strict=True):
        for view, old, now in zip(views, before, regions(views, cp.host), strict=True):
            expected = old.clone()
            for i, b in enumerate(cp.block_ids):
                expected[cp.first + i] = view[b].cpu()
            assert torch.equal(now, expected)
    # Load everything back into a poisoned pool, two halves on two streams at once, twice.
    for _ in range(2):
        poison_pool = random_bytes(pool.view(torch.uint8).shape, gen)
        pool.view(torch.uint8).copy_(poison_pool.to("cuda"))
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for s, half in zip(streams, (chunks[::2], chunks[1::2]), strict=True):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                mover.scatter_many(half, views)
        torch.cuda.synchronize()
        now = pool.view(torch.uint8).cpu()
        moved = set(ids[:at])
        for b in range(97):
            assert torch.equal(now[b], original[b] if b in moved else poison_pool[b]), b


# ---- the staged mover's copy plan (CPU: it is address arithmetic) ---------------------------------


def test_staged_words_are_one_type_for_a_view_and_its_region():
    """A view whose rows allow int64 and a staging region that allows only int16 (views of unequal
    widths) must both be indexed as int16: an ``index_select`` into an ``out`` of another width
    resizes ``out`` into new memory instead of failing, and the window would keep stale bytes."""
    from kvdepot.transfer.staged import _as_words

    view = torch.zeros(4, 64, dtype=torch.uint8)  # rows of 64 bytes: int64 on their own
    region = torch.zeros(4 * 64 + 2, dtype=torch.uint8)[2:].view(4, 64)  # starts 2 bytes in
    assert [t.dtype for t in _as_words(view)] == [torch.int64]
    assert [t.dtype for t in _as_words(view, region)] == [torch.int16, torch.int16]
    odd = torch.zeros(4, 66, dtype=torch.uint8)[:, :64]  # rows 66 bytes apart
    assert [t.dtype for t in _as_words(odd)] == [torch.int16]


def _slots(arena: torch.Tensor, count: int) -> list[torch.Tensor]:
    size = arena.numel() // count
    return [arena[k * size : (k + 1) * size] for k in range(count)]


@pytest.mark.parametrize("per_layer", [False, True])
def test_window_copies_move_exactly_each_chunks_part_and_merge_only_back_to_back_parts(per_layer):
    """The staged mover copies a window with one (host, staging) pair per run of chunk parts that
    lie back to back in one allocation. Executed on the CPU, the pairs must fill the staging
    window view-major with exactly each chunk's listed positions, and write back only those."""
    from kvdepot.transfer.base import ChunkCopy
    from kvdepot.transfer.staged import _window_copies

    c = dict(num_blocks=24, layers=3, kv=2, elems=8, dtype=torch.float16, per_layer=per_layer, seed=5)
    _pool, views, gen = make_pool(c, "cpu")
    per_block, bpc = sum(v.shape[1] for v in views), 4
    slots = _slots(random_bytes((8 * bpc * per_block,), gen), 8)  # one arena of 8 slots
    elsewhere = random_bytes((bpc * per_block,), gen)  # another allocation
    window = [
        ChunkCopy([0, 1, 2, 3], slots[2]), ChunkCopy([4, 5, 6, 7], slots[3]),  # back to back
        ChunkCopy([8, 9], slots[4], first=2),  # starts inside its slot, ends where slot 5 starts
        ChunkCopy([10, 11, 12, 13], slots[5]),
        ChunkCopy([14, 15, 16], elsewhere),  # ends before its slot does
        ChunkCopy([17, 18, 19, 20], slots[6]),  # not adjacent to the chunk before it
        ChunkCopy([21, 22], slots[0]),
    ]
    total = sum(len(cp.block_ids) for cp in window)
    staging = torch.zeros(total * per_block, dtype=torch.uint8)
    pairs = _window_copies(views, window, staging)
    if not per_layer:  # one view: runs {2, 3}, {4, 5}, {elsewhere}, {6}, {0}
        assert len(pairs) == 5
    for host, stage in pairs:
        stage.copy_(host)
    expected = []
    for v in range(len(views)):
        for cp in window:
            region = list(view_regions(views, cp.host))[v][1]
            expected.append(region[cp.first : cp.first + len(cp.block_ids)].reshape(-1))
    assert torch.equal(staging, torch.cat(expected))
    # Back: poisoned hosts receive the listed positions only.
    before = [cp.host.clone() for cp in window]
    for cp in window:
        cp.host.copy_(random_bytes(cp.host.shape, gen))
    poisoned = [cp.host.clone() for cp in window]
    for host, stage in pairs:
        host.copy_(stage)
    for cp, old, poison in zip(window, before, poisoned, strict=True):
        for (_v, now), (_, was), (_, bad) in zip(view_regions(views, cp.host), view_regions(views, old),
                                                 view_regions(views, poison), strict=True):
            for pos in range(now.shape[0]):
                listed = cp.first <= pos < cp.first + len(cp.block_ids)
                assert torch.equal(now[pos], was[pos] if listed else bad[pos]), (pos, listed)


