"""``kvdepot.transfer``: ``block_runs`` and the torch mover's gather/scatter, byte for byte.

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

from kvdepot.transfer import MOVERS, TorchBlockMover, block_runs
from kvdepot.transfer.base import view_regions

DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int8]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Every mover on CUDA; on CPU they all fall back to the per-run copies, tested once.
DEVICE_MOVERS = [("cpu", "runs")] + [pytest.param("cuda", name, marks=pytest.mark.gpu) for name in sorted(MOVERS)]


def random_bytes(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


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


@st.composite
def cases(draw):
    num_blocks = draw(st.integers(1, 12))
    order = draw(st.permutations(range(num_blocks)))
    ids = order[: draw(st.integers(0, num_blocks))]  # distinct ids, random order, random count
    return dict(
        num_blocks=num_blocks,
        layers=draw(st.integers(1, 3)),
        kv=draw(st.sampled_from([1, 2])),
        elems=draw(st.integers(1, 24)),
        dtype=draw(st.sampled_from(DTYPES)),
        # one cross-layer view, one view per layer (strided), or two views of different widths
        per_layer=draw(st.sampled_from([False, True, "uneven"])),
        ids=ids,
        first=draw(st.integers(0, 3)),
        spare=draw(st.integers(0, 2)),  # host positions after the copied ones
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_pool(c, device):
    """A pool of ``c['dtype']`` with random bytes, and its block views (uint8)."""
    gen = torch.Generator().manual_seed(c["seed"])
    pool = torch.empty(c["num_blocks"], c["layers"], c["kv"], c["elems"], dtype=c["dtype"])
    pool.view(torch.uint8).copy_(random_bytes(pool.view(torch.uint8).shape, gen))
    pool = pool.to(device)
    raw = pool.view(torch.uint8)
    if c["per_layer"] == "uneven" and c["layers"] > 1:  # segments of two sizes: layer 0, then the rest
        views = [raw[:, :1].reshape(c["num_blocks"], -1), raw[:, 1:].reshape(c["num_blocks"], -1)]
    elif c["per_layer"]:
        views = [raw[:, layer].reshape(c["num_blocks"], -1) for layer in range(c["layers"])]
    else:
        views = [raw.reshape(c["num_blocks"], -1)]
    return pool, views, gen


def host_buffer(positions: int, block_bytes: int, gen: torch.Generator, device: str) -> torch.Tensor:
    buf = random_bytes((positions * block_bytes,), gen)
    return buf.pin_memory() if device == "cuda" else buf


def run_on_side_stream(device, fn):
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        side.synchronize()
    else:
        fn()


def regions(views, buf):
    return [region.cpu().clone() for _, region in view_regions(views, buf)]


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


# ---- the batch mover's copy list (CPU: it is address arithmetic) --------------------------------


def _execute(dst, src, sizes) -> None:
    """What the driver does with a batch, done by the CPU on CPU addresses."""
    import ctypes

    for d, s_, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s_, n)


def _chunked(ids, data, per_block, gen, adjacent: bool):
    """Split ids into chunks of random sizes at random first positions; ``adjacent``: the chunks'
    buffers are back-to-back slices of one arena (so runs may cross chunk boundaries)."""
    from kvdepot.transfer.base import ChunkCopy

    sizes = []
    while len(ids) > sum(sizes):
        sizes.append(data.draw(st.integers(1, len(ids) - sum(sizes))))
    firsts = [0 if adjacent else data.draw(st.integers(0, 2)) for _ in sizes]
    lengths = [f + n + (0 if adjacent else data.draw(st.integers(0, 1))) for f, n in zip(firsts, sizes, strict=True)]
    arena = random_bytes((sum(lengths) * per_block,), gen)
    copies, at, used = [], 0, 0
    for n, first, length in zip(sizes, firsts, lengths, strict=True):
        host = arena[at * per_block : (at + length) * per_block]
        copies.append(ChunkCopy(ids[used : used + n], host, first))
        at, used = at + length, used + n
    return copies


@settings(max_examples=80, deadline=None)
@given(c=cases(), data=st.data())
def test_batch_copy_list_moves_exactly_what_the_reference_mover_moves(c, data):
    """Executed on the CPU, ``copy_runs`` must do what the per-run mover does (the same host bytes
    after a store, the same pool bytes after a load into poison) with one copy per maximal run of
    blocks adjacent in both the pool and the host buffers."""
    from kvdepot.transfer.base import ChunkCopy
    from kvdepot.transfer.batch import copy_runs

    pool, views, gen = make_pool(c, "cpu")
    if data.draw(st.booleans()):  # consecutive ids in some chunks, so runs exist to merge
        c["ids"] = sorted(c["ids"])
    per_block = sum(v.shape[1] for v in views)
    copies = _chunked(c["ids"], data, per_block, gen, adjacent=data.draw(st.booleans()))
    reference = [ChunkCopy(cp.block_ids, cp.host.clone(), cp.first) for cp in copies]
    TorchBlockMover().gather_many(views, reference)
    pool_at, host_at, sizes = copy_runs(views, copies)
    assert sizes.sum() == len(c["ids"]) * per_block
    for k in range(len(sizes) - 1):  # maximal: no copy continues where the one before it ended
        assert not (pool_at[k] + sizes[k] == pool_at[k + 1] and host_at[k] + sizes[k] == host_at[k + 1])
    _execute(host_at, pool_at, sizes)
    for ours, theirs in zip(copies, reference, strict=True):
        assert torch.equal(ours.host, theirs.host)
    raw = pool.view(torch.uint8)
    poison = random_bytes(raw.shape, gen)
    raw.copy_(poison)
    _execute(pool_at, host_at, sizes)
    ours = raw.clone()
    raw.copy_(poison)
    TorchBlockMover().scatter_many(reference, views)
    assert torch.equal(ours, raw)


def test_batch_copy_list_merges_blocks_adjacent_on_both_sides_across_chunks():
    from kvdepot.transfer.base import ChunkCopy
    from kvdepot.transfer.batch import copy_runs

    pool = torch.zeros(10, 8, dtype=torch.uint8)
    arena = torch.zeros(6 * 8, dtype=torch.uint8)
    copies = [ChunkCopy([2, 3], arena[:16]), ChunkCopy([4, 7], arena[16:32]), ChunkCopy([8], arena[40:48])]
    pool_at, host_at, sizes = copy_runs([pool], copies)
    base, host = pool.data_ptr(), arena.data_ptr()
    # 2,3,4 are one span on both sides; 7 and 8 are adjacent in the pool but not in the arena
    assert list(zip(pool_at.tolist(), host_at.tolist(), sizes.tolist(), strict=True)) == [
        (base + 16, host, 24), (base + 56, host + 24, 8), (base + 64, host + 40, 8)]


def test_batch_copy_list_never_joins_two_allocations_that_lie_back_to_back():
    """Two pinned arena segments can sit next to each other in the address space; one copy
    spanning both is refused by the driver (CUDA_ERROR_INVALID_VALUE) and the store is lost."""
    import numpy as np

    from kvdepot.transfer.base import ChunkCopy
    from kvdepot.transfer.batch import copy_runs

    pool = torch.zeros(10, 8, dtype=torch.uint8)
    memory = np.zeros(32, dtype=np.uint8)
    first, second = torch.from_numpy(memory[:16]), torch.from_numpy(memory[16:])  # two storages, adjacent
    assert first.data_ptr() + 16 == second.data_ptr()
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    _, host_at, sizes = copy_runs([pool], [ChunkCopy([2, 3], first), ChunkCopy([4, 5], second)])
    assert sizes.tolist() == [16, 16] and host_at.tolist() == [first.data_ptr(), second.data_ptr()]
    one = torch.from_numpy(memory)  # the same bytes as one allocation: one copy
    assert copy_runs([pool], [ChunkCopy([2, 3], one[:16]), ChunkCopy([4, 5], one[16:])])[2].tolist() == [32]


def test_batch_call_refuses_the_default_stream_and_ragged_lists_before_touching_the_driver():
    import numpy as np

    from kvdepot.transfer import cuda_batch

    one = np.array([1], dtype=np.uint64)
    with pytest.raises(ValueError, match="default stream"):
        cuda_batch.memcpy_batch(one, one, one, 0)
    with pytest.raises(ValueError, match="differ in length"):
        cuda_batch.memcpy_batch(one, np.array([1, 2], dtype=np.uint64), one, 7)
    cuda_batch.memcpy_batch(one[:0], one[:0], one[:0], 7)  # nothing to copy: no driver needed


def test_batch_mover_on_cpu_pools_is_the_per_run_mover():
    from kvdepot.transfer import BatchBlockMover

    c = dict(num_blocks=5, layers=2, kv=2, elems=6, dtype=torch.bfloat16, per_layer=True, seed=3)
    pool, views, gen = make_pool(c, "cpu")
    buf = host_buffer(4, sum(v.shape[1] for v in views), gen, "cpu")
    expected = buf.clone()
    TorchBlockMover().gather(views, [4, 0, 2], expected, 1)
    BatchBlockMover().gather(views, [4, 0, 2], buf, 1)
    assert torch.equal(buf, expected)


@pytest.mark.parametrize("growing", [False, True])
@pytest.mark.parametrize("refuse_call", [None, 1, 3])
def test_batch_mover_redoes_a_refused_move_with_torch_and_counts_it(monkeypatch, caplog, refuse_call, growing):
    """A move the driver refuses part of is done again by per-run copies: a store is not lost and
    a load never leaves the pool unwritten (TensorRT-LLM could not hear of a failed load). The
    windows it did hand over partition the copy list in order, and grow from the first one."""
    import ctypes

    from kvdepot.transfer import BatchBlockMover, cuda_batch
    from kvdepot.transfer.base import ChunkCopy

    calls = []

    def driver(dst, src, sizes, stream):
        calls.append((dst.tolist(), src.tolist(), sizes.tolist()))
        if len(calls) == refuse_call:
            raise RuntimeError("cuMemcpyBatchAsync_v2 failed: CUDA_ERROR_INVALID_VALUE (1)")
        for d, s_, n in zip(*calls[-1], strict=True):
            ctypes.memmove(d, s_, n)

    c = dict(num_blocks=12, layers=2, kv=2, elems=16, dtype=torch.float16, per_layer=True, seed=9)
    pool, views, gen = make_pool(c, "cpu")
    per_block = sum(v.shape[1] for v in views)
    mover = BatchBlockMover(window_bytes=2 * per_block, first_window_bytes=per_block // 4 if growing else None)
    monkeypatch.setattr(BatchBlockMover, "_stream", staticmethod(lambda views, copies: 7))  # as if on CUDA
    monkeypatch.setattr(cuda_batch, "memcpy_batch", driver)
    ids = torch.randperm(12, generator=gen).tolist()
    copies = [ChunkCopy(ids[k : k + 2], random_bytes((3 * per_block,), gen), k % 2) for k in range(0, 12, 2)]
    expected = [ChunkCopy(cp.block_ids, cp.host.clone(), cp.first) for cp in copies]
    TorchBlockMover().gather_many(views, expected)
    with caplog.at_level("WARNING", logger="kvdepot"):
        mover.gather_many(views, copies)
    for ours, theirs in zip(copies, expected, strict=True):
        assert torch.equal(ours.host, theirs.host)
    if refuse_call is None:
        assert mover.refused == 0 and len(calls) > 1
        assert sum(sum(sizes) for _, _, sizes in calls) == 12 * per_block
        assert all(sum(sizes) <= 2 * per_block for _, _, sizes in calls)
        spans = [sum(sizes) for _, _, sizes in calls]
        assert (spans[0] < spans[1] <= spans[2]) if growing else spans[0] == 2 * per_block
    else:
        assert len(calls) == refuse_call and mover.refused == 1 and "refused a batched copy" in caplog.text
    original = pool.view(torch.uint8).clone()
    pool.view(torch.uint8).zero_()
    mover.scatter_many(copies, views)
    assert torch.equal(pool.view(torch.uint8), original)


@pytest.mark.parametrize("refuse_call", [None, 1, 3])
def test_batch_mover_scatters_layer_by_layer(monkeypatch, caplog, refuse_call):
    """``scatter_layers`` on a cross-layer pool: once it has yielded ``l``, layers 0..l of every
    listed block hold the host bytes and later layers are untouched (nothing is copied ahead of
    the caller's ``next()``); at the end the pool is exactly what a whole scatter writes. A
    refused call finishes the move whole, and every layer is still yielded once, in order. (The
    driver is played by memmove on CPU memory.)"""
    import ctypes

    from kvdepot.transfer import cuda_batch
    from kvdepot.transfer.base import ChunkCopy
    from kvdepot.transfer.batch import BatchBlockMover

    calls = []

    def driver(dst, src, sizes, stream):
        calls.append(len(sizes))
        if len(calls) == refuse_call:
            raise RuntimeError("cuMemcpyBatchAsync_v2 failed: CUDA_ERROR_INVALID_VALUE (1)")
        for d, s_, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s_, n)

    layers = 4
    c = dict(num_blocks=10, layers=layers, kv=2, elems=8, dtype=torch.bfloat16, per_layer=False, seed=4)
    pool, views, gen = make_pool(c, "cpu")
    per_block = views[0].shape[1]
    monkeypatch.setattr(BatchBlockMover, "_stream", staticmethod(lambda views, copies: 7))
    monkeypatch.setattr(cuda_batch, "memcpy_batch", driver)
    ids = torch.randperm(10, generator=gen).tolist()
    copies = [ChunkCopy(ids[k : k + 3], random_bytes((4 * per_block,), gen), k % 2) for k in range(0, 9, 3)]
    got = pool.view(torch.uint8)  # bytes: random bf16 bits hold NaNs, which never compare equal
    want = got.clone()
    TorchBlockMover().scatter_many(copies, [want.reshape(10, -1)])
    poison = got.clone()
    reported = []
    with caplog.at_level("WARNING", logger="kvdepot"):
        for layer in BatchBlockMover().scatter_layers(copies, views, layers):
            reported.append(layer)
            if refuse_call is None:
                assert len(calls) == layer + 1  # one driver call per layer, none ahead
                assert torch.equal(got[ids[:9], : layer + 1], want[ids[:9], : layer + 1])
                assert torch.equal(got[ids[:9], layer + 1 :], poison[ids[:9], layer + 1 :])
    assert reported == list(range(layers))
    assert torch.equal(got, want)  # the listed blocks loaded, block 9 (not listed) untouched
    assert (refuse_call is None) == ("refused" not in caplog.text)


def test_batch_mover_scatters_whole_where_it_cannot_split_by_layer():
    """Per-layer views (one view per layer: not a cross-layer pool) or a CPU pool: the move is
    whole at the first step, and every layer is yielded after it."""
    from kvdepot.transfer.base import ChunkCopy
    from kvdepot.transfer.batch import BatchBlockMover

    c = dict(num_blocks=6, layers=3, kv=2, elems=8, dtype=torch.float16, per_layer=True, seed=2)
    pool, views, gen = make_pool(c, "cpu")
    per_block = sum(v.shape[1] for v in views)
    copies = [ChunkCopy([4, 1], random_bytes((2 * per_block,), gen))]
    want = pool.view(torch.uint8).clone()
    TorchBlockMover().scatter_many(copies, [want[:, layer].reshape(6, -1) for layer in range(3)])
    reported = [(layer, pool.view(torch.uint8).clone()) for layer in BatchBlockMover().scatter_layers(copies, views, 3)]
    assert [layer for layer, _ in reported] == [0, 1, 2]
    assert all(torch.equal(seen, want) for _, seen in reported)


def test_window_bounds_partition_the_copies_in_order():
    import numpy as np

    from kvdepot.transfer.batch import window_bounds

    assert window_bounds(np.array([], dtype=np.int64), 10) == []
    assert window_bounds(np.array([4, 4, 4, 4, 25, 1, 9]), 10) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert window_bounds(np.array([10, 10, 10]), 10) == [(0, 1), (1, 2), (2, 3)]
    # Growing windows: 1, then 2, 4, 8 copies of one unit, then at most 8 per window.
    assert window_bounds(np.ones(23, dtype=np.int64), 8, first_bytes=1) == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 23)]
    sizes = np.random.default_rng(0).integers(1, 50, 500)
    bounds = window_bounds(sizes, 300, first_bytes=20)
    assert [lo for lo, _ in bounds[1:]] == [hi for _, hi in bounds[:-1]] and bounds[0][0] == 0 and bounds[-1][1] == 500
    spans = [int(sizes[lo:hi].sum()) for lo, hi in bounds]
    assert spans[0] <= 20 + 49 and max(spans) <= 300 + 49 and spans[1] > spans[0]


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["pageable", "default stream"])
def test_batch_mover_falls_back_where_the_driver_call_cannot_serve(where):
    """Pageable host memory and the legacy default stream are not for the batch call: the move
    still happens, bit-exact, by per-run torch copies."""
    from kvdepot.transfer import BatchBlockMover

    c = dict(num_blocks=6, layers=2, kv=2, elems=32, dtype=torch.float16, per_layer=False, seed=4)
    pool, views, gen = make_pool(c, "cuda")
    original = pool.view(torch.uint8).cpu().clone()
    buf = random_bytes((3 * views[0].shape[1],), gen)
    if where != "pageable":
        buf = buf.pin_memory()
    mover = BatchBlockMover()

    def move(fn):
        if where == "default stream":
            fn()  # on torch's default stream
        else:
            run_on_side_stream("cuda", fn)
        torch.cuda.synchronize()

    move(lambda: mover.gather(views, [5, 1, 3], buf))
    assert torch.equal(buf.view(3, -1), original[[5, 1, 3]].view(3, -1))
    pool.view(torch.uint8).zero_()
    move(lambda: mover.scatter(buf, views, [0, 2, 4]))
    assert torch.equal(pool.view(torch.uint8).cpu()[[0, 2, 4]], original[[5, 1, 3]])


@pytest.mark.gpu
def test_batch_mover_never_spans_two_host_registrations_that_touch():
    """Two pinned allocations back to back in the address space (two cudaHostRegister calls on
    the halves of one buffer: what adjacent arena segments looked like in the MP server). Blocks
    consecutive in the pool and across the two halves must go as two copies: the driver refuses
    one copy spanning both (before the fix: dropped stores). Nothing refused, bytes exact."""
    import numpy as np

    from kvdepot.transfer import BatchBlockMover, cuda_batch
    from kvdepot.transfer.base import ChunkCopy

    if not cuda_batch.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync_v2")
    c = dict(num_blocks=8, layers=2, kv=2, elems=1024, dtype=torch.bfloat16, per_layer=False, seed=12)
    pool, views, gen = make_pool(c, "cuda")
    seg = views[0].shape[1]
    raw = np.zeros(4 * seg + 4096, dtype=np.uint8)
    memory = raw[-raw.ctypes.data % 4096 :][: 4 * seg]  # page-aligned halves (seg is 8 KiB): no shared page
    halves = [torch.from_numpy(memory[: 2 * seg]), torch.from_numpy(memory[2 * seg :])]
    cudart = torch.cuda.cudart()
    for half in halves:
        assert int(cudart.cudaHostRegister(half.data_ptr(), half.numel(), 0)) == 0
    try:
        assert all(h.is_pinned() for h in halves)
        mover = BatchBlockMover()
        copies = [ChunkCopy([2, 3], halves[0]), ChunkCopy([4, 5], halves[1])]  # pool 2..5: one span
        run_on_side_stream("cuda", lambda: mover.gather_many(views, copies))
        assert mover.refused == 0
        assert torch.equal(torch.from_numpy(memory).view(4, seg), pool.view(torch.uint8).cpu().view(8, seg)[2:6])
        pool.view(torch.uint8).zero_()
        run_on_side_stream("cuda", lambda: mover.scatter_many(copies, views))
        assert mover.refused == 0
        assert torch.equal(pool.view(torch.uint8).cpu().view(8, seg)[2:6], torch.from_numpy(memory).view(4, seg))
    finally:
        torch.cuda.synchronize()
        for half in halves:
            cudart.cudaHostUnregister(half.data_ptr())
