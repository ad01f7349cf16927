"""``kvdepot.transfer.batch``: windows, refusals, lanes, loads layer by layer, and a store moved by
two threads at once (``head`` on the caller, ``rest`` on the issuer) — on the CPU through
``pools.HostDriver`` (the driver's copies, played by memmove), and marked ``gpu`` on CUDA."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from pools import HostDriver, host_buffer, make_pool, random_bytes, run_on_side_stream

from kvdepot.transfer import BatchBlockMover, TorchBlockMover, cuda_batch
from kvdepot.transfer.base import ChunkCopy
from kvdepot.transfer.batch import EARLY_COPIES, window_bounds
from kvdepot.transfer.plan import CopyList


def test_batch_call_refuses_the_default_stream_and_lists_it_does_not_hold_before_touching_the_driver():
    table = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64)
    listing = CopyList(table)
    with pytest.raises(ValueError, match="default stream"):
        cuda_batch.memcpy_batch(listing, 0, 1, 0)
    with pytest.raises(ValueError, match="not within"):
        cuda_batch.memcpy_batch(listing, 1, 3, 7)
    cuda_batch.memcpy_batch(listing, 1, 1, 7)  # nothing to copy: no driver needed
    assert listing.pointers(1) == (table.ctypes.data + 8, table.ctypes.data + 24, table.ctypes.data + 40)


def test_batch_mover_on_cpu_pools_is_the_per_run_mover():
    c = dict(num_blocks=5, layers=2, kv=2, elems=6, dtype=torch.bfloat16, per_layer=True, seed=3)
    pool, views, gen = make_pool(c, "cpu")
    buf = host_buffer(4, sum(v.shape[1] for v in views), gen, "cpu")
    expected = buf.clone()
    TorchBlockMover().gather(views, [4, 0, 2], expected, 1)
    BatchBlockMover().gather(views, [4, 0, 2], buf, 1)
    assert torch.equal(buf, expected)


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("growing", [False, True])
@pytest.mark.parametrize("refuse_call", [None, 1, 3])
def test_batch_mover_redoes_a_refused_move_with_torch_and_counts_it(caplog, refuse_call, growing, lanes):
    """A move the driver refuses part of is done again by per-run copies: a store is not lost and
    a load never leaves the pool unwritten (TensorRT-LLM could not hear of a failed load). The
    windows it did hand over partition the copy list in order, and grow from the first one; with
    lanes they alternate over the streams, and every lane is joined back, refused or not."""
    c = dict(num_blocks=12, layers=2, kv=2, elems=16, dtype=torch.float16, per_layer=True, seed=9)
    pool, views, gen = make_pool(c, "cpu")
    per_block = sum(v.shape[1] for v in views)
    driver = HostDriver(refuse_call=refuse_call)
    mover = BatchBlockMover(window_bytes=2 * per_block, first_window_bytes=per_block // 4 if growing else None,
                            lanes=lanes, driver=driver)
    ids = torch.randperm(12, generator=gen).tolist()
    copies = [ChunkCopy(ids[k : k + 2], random_bytes((3 * per_block,), gen), k % 2) for k in range(0, 12, 2)]
    expected = [ChunkCopy(cp.block_ids, cp.host.clone(), cp.first) for cp in copies]
    TorchBlockMover().gather_many(views, expected)
    with caplog.at_level("WARNING", logger="kvdepot"):
        mover.gather_many(views, copies)
    for ours, theirs in zip(copies, expected, strict=True):
        assert torch.equal(ours.host, theirs.host)
    calls = driver.calls
    assert [c["stream"] for c in calls] == [["stream", "lane1"][k % lanes] for k in range(len(calls))]
    assert driver.joins == [("stream", lane) for lane in driver.lanes] and len(driver.lanes) == lanes - 1
    if refuse_call is None:
        assert mover.refused == 0 and len(calls) > 1
        assert driver.bytes_moved() == 12 * per_block
        assert all(sum(c["sizes"]) <= 2 * per_block for c in calls)
        spans = [sum(c["sizes"]) for c in calls]
        assert (spans[0] < spans[1] <= spans[2]) if growing else spans[0] == 2 * per_block
    else:
        assert len(calls) == refuse_call and mover.refused == 1 and "refused a batched copy" in caplog.text
    original = pool.view(torch.uint8).clone()
    pool.view(torch.uint8).zero_()
    mover.scatter_many(copies, views)
    assert torch.equal(pool.view(torch.uint8), original)


@pytest.mark.parametrize("refuse_call", [None, 1, 3])
def test_batch_mover_scatters_layer_by_layer(caplog, refuse_call):
    """``scatter_layers`` on a cross-layer pool: once it has yielded ``l``, layers 0..l of every
    listed block hold the host bytes and later layers are untouched (nothing is copied ahead of
    the caller's ``next()``); at the end the pool is exactly what a whole scatter writes. A
    refused call finishes the move whole, and every layer is still yielded once, in order. (The
    driver is played by memmove on CPU memory.)"""
    layers = 4
    c = dict(num_blocks=10, layers=layers, kv=2, elems=8, dtype=torch.bfloat16, per_layer=False, seed=4)
    pool, views, gen = make_pool(c, "cpu")
    per_block = views[0].shape[1]
    driver = HostDriver(refuse_call=refuse_call)
    ids = torch.randperm(10, generator=gen).tolist()
    copies = [ChunkCopy(ids[k : k + 3], random_bytes((4 * per_block,), gen), k % 2) for k in range(0, 9, 3)]
    got = pool.view(torch.uint8)  # bytes: random bf16 bits hold NaNs, which never compare equal
    want = got.clone()
    TorchBlockMover().scatter_many(copies, [want.reshape(10, -1)])
    poison = got.clone()
    reported = []
    with caplog.at_level("WARNING", logger="kvdepot"):
        for layer in BatchBlockMover(lanes=2, driver=driver).scatter_layers(copies, views, layers):
            reported.append(layer)
            if refuse_call is None:
                assert len(driver.calls) == layer + 1  # one driver call per layer, none ahead
                assert torch.equal(got[ids[:9], : layer + 1], want[ids[:9], : layer + 1])
                assert torch.equal(got[ids[:9], layer + 1 :], poison[ids[:9], layer + 1 :])
    assert reported == list(range(layers))
    assert torch.equal(got, want)  # the listed blocks loaded, block 9 (not listed) untouched
    assert (refuse_call is None) == ("refused" not in caplog.text)
    assert not driver.lanes and {c["stream"] for c in driver.calls} == {"stream"}  # lanes: whole moves only


def test_batch_mover_scatters_whole_where_it_cannot_split_by_layer():
    """Per-layer views (one view per layer: not a cross-layer pool) or a CPU pool: the move is
    whole at the first step, and every layer is yielded after it."""
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


# ---- a store in two parts: head (the engine's caller) and rest (its issuer) ----------------------


def _store_case(seed: int = 5, chunks: int = 6, num_blocks: int = 16):
    """A pool, a store of ``chunks`` chunks of two blocks, the bytes it must produce, and windows
    of one block's bytes doubling to four (so a move has several)."""
    c = dict(num_blocks=num_blocks, layers=2, kv=2, elems=16, dtype=torch.float16, per_layer=False, seed=seed)
    pool, views, gen = make_pool(c, "cpu")
    per_block = views[0].shape[1]
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    copies = [ChunkCopy(ids[2 * k : 2 * k + 2], random_bytes((2 * per_block,), gen)) for k in range(chunks)]
    expected = [cp.host.clone() for cp in copies]
    TorchBlockMover().gather_many(views, [ChunkCopy(cp.block_ids, e) for cp, e in zip(copies, expected, strict=True)])
    return views, copies, expected, per_block


def _windows(driver: HostDriver) -> list[tuple[int, ...]]:
    return [tuple(c["dst"]) for c in driver.calls]


def test_a_head_takes_windows_up_to_its_bytes_and_the_rest_takes_the_others_once():
    views, copies, expected, per_block = _store_case()
    driver = HostDriver()
    mover = BatchBlockMover(window_bytes=4 * per_block, first_window_bytes=per_block, early_bytes=0, driver=driver)
    move = mover.prepare_gather(views, copies)
    move.head(3 * per_block)  # windows of 1 and 2 blocks end within 3 blocks; the next (4) would not
    assert [sum(c["sizes"]) for c in driver.calls] == [per_block, 2 * per_block]
    move.rest()
    assert driver.bytes_moved() == 12 * per_block and len(set(_windows(driver))) == len(driver.calls)
    assert all(torch.equal(cp.host, e) for cp, e in zip(copies, expected, strict=True))
    small = mover.prepare_gather(views, copies)
    driver.calls.clear()
    small.head(1)  # less than the first window: the head still takes that one (the engines start)
    assert len(driver.calls) == 1
    small.rest()


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize(("early_blocks", "calls"), [
    (3, [[1, 1, 1], [1] * 4, [1] * 4, [1]]),  # a byte bound that splits the second chunk; numpy lists the rest
    (100, [[1] * 4] * 3),  # Python windows (up to 16 copies, but a window's 4 blocks) list it all
    (0, [[1], [1, 1], [1] * 4, [1] * 4, [1]]),  # none: numpy from the first window (growing from one block)
])
def test_early_windows_built_in_python_then_the_rest_move_every_block_once(to_host, early_blocks, calls):
    """The first windows of a one-view move are built in plain Python (``plan.head_list``: 16 copies,
    then 32, within ``window_bytes``, up to ``early_bytes``), each enqueued before the next
    is listed, then the rest with numpy in windows growing on from the last early one's size. Each window holds the next
    blocks in order; every block moves once, bit-exact, in either direction."""
    views, copies, expected, per_block = _store_case()
    driver = HostDriver()
    mover = BatchBlockMover(window_bytes=4 * per_block, first_window_bytes=per_block, early_bytes=early_blocks * per_block,
                            driver=driver)
    if to_host:
        mover.gather_many(views, copies)
        assert all(torch.equal(cp.host, e) for cp, e in zip(copies, expected, strict=True))
    else:
        for cp, e in zip(copies, expected, strict=True):
            cp.host.copy_(e)
        listed = [b for cp in copies for b in cp.block_ids]
        original = views[0][listed].clone()
        views[0].zero_()
        mover.scatter_many(copies, views)
        assert torch.equal(views[0][listed], original)
    assert [[size // per_block for size in c["sizes"]] for c in driver.calls] == calls
    order = [b for cp in copies for b in cp.block_ids]
    pool_side = [a for c in driver.calls for a in c["src" if to_host else "dst"]]
    assert pool_side == [views[0][b].data_ptr() for b in order]  # random ids: one copy per block, in order
    # Each host allocation (a chunk's buffer) is asked about once per move.
    assert sum(driver.pinned_checks) == len(copies)


def test_an_early_window_merges_blocks_that_follow_each_other():
    """Consecutive pool blocks in one host buffer are one copy in the early windows too; a chunk's
    own buffer starts a new copy (another allocation)."""
    first = EARLY_COPIES[0]  # copies in the first window
    c = dict(num_blocks=3 * first + 3, layers=2, kv=2, elems=16, dtype=torch.float16, per_layer=False, seed=3)
    pool, views, gen = make_pool(c, "cpu")
    per_block = views[0].shape[1]
    copies = [ChunkCopy(list(range(3 * k, 3 * k + 3)), random_bytes((3 * per_block,), gen)) for k in range(first + 1)]
    driver = HostDriver()
    BatchBlockMover(driver=driver).gather_many(views, copies)
    assert [c["sizes"] for c in driver.calls] == [[3 * per_block] * first, [3 * per_block]]  # a window, then 1
    assert driver.bytes_moved() == 3 * (first + 1) * per_block
    for cp in copies:
        assert torch.equal(cp.host.view(3, -1), views[0][cp.block_ids])


def test_host_buffers_the_driver_cannot_copy_are_moved_by_torch_however_far_the_move_got():
    """A pageable buffer among the early window's, or only among the rest's (the early window
    already enqueued): torch copies the whole move, bit-exact, and nothing is counted refused."""
    views, copies, expected, per_block = _store_case()

    class RestUnpinned(HostDriver):
        def pinned(self, hosts):
            super().pinned(hosts)
            return len(self.pinned_checks) == 1  # the early window's buffers only

    for driver, calls in ((HostDriver(unpinned=True), 0), (RestUnpinned(), 1)):
        for cp in copies:
            cp.host.zero_()
        mover = BatchBlockMover(early_bytes=3 * per_block, driver=driver)
        mover.gather_many(views, copies)
        assert len(driver.calls) == calls and mover.refused == 0
        assert all(torch.equal(cp.host, e) for cp, e in zip(copies, expected, strict=True))


def test_a_head_on_one_thread_and_the_rest_on_another_move_every_block_once():
    """As the engine does it: the caller's thread enqueues the head, the issuer thread the rest."""
    views, copies, expected, per_block = _store_case()
    driver = HostDriver()
    mover = BatchBlockMover(window_bytes=2 * per_block, first_window_bytes=per_block, early_bytes=0, driver=driver)
    move = mover.prepare_gather(views, copies)
    caller = threading.Thread(target=move.head, args=(3 * per_block,), name="caller")
    caller.start()
    caller.join(30)
    issuer = threading.Thread(target=move.rest, name="issuer")
    issuer.start()
    issuer.join(30)
    assert [c["thread"] for c in driver.calls] == ["caller"] * 2 + ["issuer"] * (len(driver.calls) - 2)
    assert driver.bytes_moved() == 12 * per_block and len(set(_windows(driver))) == len(driver.calls)
    assert all(torch.equal(cp.host, e) for cp, e in zip(copies, expected, strict=True))


def test_what_the_head_cannot_do_is_raised_by_the_rest_or_redone_by_torch(caplog):
    """The head never raises (it runs on the engine's step loop): an error is raised by the rest
    (the issuer drops the store), a refused window makes the rest move it all with torch."""
    views, copies, expected, per_block = _store_case()

    class Broken(HostDriver):
        def copy(self, copies, lo, hi, stream):
            raise ValueError("not a refusal")

    move = BatchBlockMover(first_window_bytes=per_block, driver=Broken()).prepare_gather(views, copies)
    move.head(1 << 30)
    with pytest.raises(ValueError, match="not a refusal"):
        move.rest()
    driver = HostDriver(refuse_call=1)
    mover = BatchBlockMover(window_bytes=2 * per_block, first_window_bytes=per_block, early_bytes=0, driver=driver)
    move = mover.prepare_gather(views, copies)
    with caplog.at_level("WARNING", logger="kvdepot"):
        move.head(1 << 30)
        assert len(driver.calls) == 1  # refused: nothing more is handed to the driver
        move.rest()
    assert len(driver.calls) == 1 and mover.refused == 1 and "refused a batched copy" in caplog.text
    assert all(torch.equal(cp.host, e) for cp, e in zip(copies, expected, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("early", [0, 3, None])
@pytest.mark.parametrize("lanes", [1, 2])
def test_batch_mover_on_cuda_with_lanes_and_a_store_issued_by_two_threads(lanes, early):
    """On the device: a store whose head is enqueued by a fresh thread (its first driver call
    needs the context made current there) and the rest by another, on the same stream (with
    lanes joined back into it), then a load of it all into a poisoned pool; the stream waited
    on sees every byte. ``early``: the Python-built first window off, of 3 blocks (splitting a
    chunk), or the default (32 blocks: half the move)."""
    from kvdepot.transfer import cuda_batch

    if not cuda_batch.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync_v2")
    c = dict(num_blocks=64, layers=2, kv=2, elems=512, dtype=torch.bfloat16, per_layer=False, seed=21)
    pool, views, gen = make_pool(c, "cuda")
    original = pool.view(torch.uint8).cpu().clone()
    per_block = views[0].shape[1]
    sizes = {} if early is None else {"early_bytes": early * per_block}
    mover = BatchBlockMover(window_bytes=8 * per_block, first_window_bytes=per_block, lanes=lanes, **sizes)
    ids = torch.randperm(64, generator=gen).tolist()
    copies = [ChunkCopy(ids[k : k + 4], host_buffer(4, per_block, gen, "cuda")) for k in range(0, 64, 4)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    move = mover.prepare_gather(views, copies)

    def head():
        with torch.cuda.stream(side):
            move.head(4 * per_block)

    caller = threading.Thread(target=head)  # a thread that has done nothing on the device yet
    caller.start()
    caller.join()
    with torch.cuda.stream(side):
        move.rest()
    side.synchronize()
    assert mover.refused == 0
    for cp in copies:
        assert torch.equal(cp.host.view(4, -1), original[cp.block_ids].view(4, -1))
    pool.view(torch.uint8).zero_()
    run_on_side_stream("cuda", lambda: mover.scatter_many(copies, views))
    assert torch.equal(pool.view(torch.uint8).cpu(), original) and mover.refused == 0


@pytest.mark.gpu
def test_the_driver_remembers_a_pinned_allocation_only_while_its_owner_lives():
    """``CudaDriver.pinned`` asks the driver once per allocation and remembers the answer through
    the tensor that owns the memory (a slot's base): once that is gone, so is the answer, and an
    allocation reusing the address is asked again; pageable memory is never taken for pinned."""
    def allocation(t):
        return {t.untyped_storage().data_ptr(): t}

    driver = cuda_batch.CudaDriver()
    segment = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    slot = segment[4096:8192]
    key = slot.untyped_storage().data_ptr()
    assert driver.pinned(allocation(slot)) and driver._pinned.get(key) is segment
    assert driver.pinned(allocation(segment[0:4096]))  # remembered: the same owner
    assert not driver.pinned(allocation(torch.empty(4096, dtype=torch.uint8)))
    assert not driver.pinned(allocation(torch.empty(4096, dtype=torch.uint8, device="cuda")))
    del slot, segment
    assert driver._pinned.get(key) is None


def test_the_driver_remembers_a_buffer_found_pinned_by_itself_while_it_lives(monkeypatch):
    """A host slot's view found pinned is remembered by itself: the next move that meets it reads
    no torch attribute (here ``_base`` raises once the first answer is in); a new view of the same
    segment goes through the owner's check; pageable memory is never remembered. (On CPU nothing
    is pinned: the segment is entered as if found pinned before.)"""
    driver = cuda_batch.CudaDriver()
    segment = torch.empty(1 << 16, dtype=torch.uint8)
    slot = segment[4096:8192]
    key = slot.untyped_storage().data_ptr()
    driver._pinned.put(key, segment)
    assert driver.pinned({key: slot}) and driver._seen.get(id(slot)) is slot

    def unread(self):
        raise AssertionError("a torch attribute was read")

    monkeypatch.setattr(torch.Tensor, "_base", property(unread))
    assert driver.pinned({key: slot})  # remembered: nothing read
    with pytest.raises(AssertionError, match="torch attribute"):
        driver.pinned({key: segment[0:4096]})  # a new view: checked through its owner
    monkeypatch.undo()
    pageable = torch.empty(4096, dtype=torch.uint8)
    assert not driver.pinned({pageable.untyped_storage().data_ptr(): pageable})
    assert driver._seen.get(id(pageable)) is None
    gone = id(slot)
    del slot
    assert driver._seen.get(gone) is None  # a dead view's answer goes with it


def test_the_driver_s_memo_sweeps_the_dead_and_never_rescans_on_every_entry():
    """Sweeps happen when the memo has doubled since the last one: tens of thousands of live
    slot views cost one scan per doubling, not one per new entry (a rescan per entry would cost
    the step loop milliseconds per move while a large arena's views are first met)."""
    memo = cuda_batch.WeakMemo()
    alive = [torch.empty(1) for _ in range(3 * memo.SWEEP_AT)]
    sweeps = []
    for n, t in enumerate(alive):
        before = memo._refs
        memo.put(n, t)
        if memo._refs is not before:  # a sweep makes the dict anew
            sweeps.append(n)
    assert len(sweeps) <= 2 and all(memo.get(n) is t for n, t in enumerate(alive))
    del t
    alive.clear()  # every one dies: the next sweep drops them all
    while len(memo) < memo._sweep_at:
        memo.put(-len(memo) - 1, torch.empty(1))  # dead at once too
    memo.put(-1, keep := torch.empty(1))
    assert len(memo) == 1 and memo.get(-1) is keep and memo._sweep_at == memo.SWEEP_AT


def test_the_issuer_starts_its_part_of_a_store_with_a_small_window_again():
    """After the caller's head, the issuer (just woken, the copy engines maybe idle) lists its
    first window small again (``EARLY_COPIES[0]``), then doubles: it does not carry on from the
    head's size."""
    first = EARLY_COPIES[0]
    views, copies, expected, per_block = _store_case(chunks=3 * first, num_blocks=6 * first)
    driver = HostDriver()
    mover = BatchBlockMover(window_bytes=6 * first * per_block, early_bytes=6 * first * per_block, driver=driver)
    move = mover.prepare_gather(views, copies)
    move.head(3 * per_block)  # the first window always goes, whatever the head's bytes
    move.rest()
    # Not first, then 2 * first. (The last window may hold a copy less: random ids can merge.)
    assert [len(c["sizes"]) for c in driver.calls][:3] == [first, first, 2 * first]
    assert driver.bytes_moved() == 6 * first * per_block
    assert all(torch.equal(cp.host, e) for cp, e in zip(copies, expected, strict=True))
