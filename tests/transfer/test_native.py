"""``kvdepot.transfer._native``, the optional C helper: the same copy lists as the Python it
stands in for (``plan._head_list_py``, ``plan._one_view``), the same driver call as ctypes', clear
errors for bad input, and no references leaked. CI builds it (``.ci/run`` checks), so these run
there; without a compiler they skip, and ``test_plan.py`` runs on the Python lists instead."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import cases, make_pool
from test_plan import _chunked

from kvdepot.transfer import cuda_batch, native, plan
from kvdepot.transfer.base import ChunkCopy
from kvdepot.transfer.plan import CopyList, make_plan

NATIVE = native.NATIVE
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the C helper is not built (no compiler at install time)")


def _rows(listing: CopyList) -> list[tuple[int, int, int]]:
    return list(zip(listing.dst.tolist(), listing.src.tolist(), listing.sizes.tolist(), strict=True))


def _parts(rest) -> list[tuple[list[int], int, int]]:
    return [(list(c.block_ids), c.host.data_ptr(), c.first) for c in rest]


def _one_view_case(c, data):
    c = {**c, "per_layer": False}
    _, views, gen = make_pool(c, "cpu")
    if data.draw(st.booleans()):  # runs to merge
        c["ids"] = sorted(c["ids"])
    per_block = views[0].shape[1]
    return make_plan(views), _chunked(c["ids"], data, per_block, gen, adjacent=data.draw(st.booleans())), per_block


@settings(max_examples=200, deadline=None)
@given(c=cases(), data=st.data())
def test_the_c_head_list_is_the_python_one(c, data):
    """Copy for copy, byte count, the parts left, and the allocations met: whatever the limits."""
    plan_, copies, per_block = _one_view_case(c, data)
    max_bytes = data.draw(st.integers(1, len(c["ids"]) + 2)) * per_block - data.draw(st.integers(0, per_block - 1))
    max_copies = data.draw(st.integers(1, 8))
    for to_host in (True, False):
        ours, taken, rest = plan._native_list(plan_, copies, to_host, max_bytes, max_copies)
        theirs, their_taken, their_rest = plan._head_list_py(plan_, copies, to_host=to_host, max_bytes=max_bytes,
                                                             max_copies=max_copies)
        assert _rows(ours) == _rows(theirs) and ours.count == theirs.count
        assert taken == their_taken and _parts(rest) == _parts(their_rest)
        assert ours.hosts.keys() == theirs.hosts.keys()
        assert all(h.untyped_storage().data_ptr() == a for a, h in ours.hosts.items())
        assert ours.ends.tolist() == theirs.ends.tolist()


@settings(max_examples=200, deadline=None)
@given(c=cases(), data=st.data())
def test_the_c_copy_list_of_one_view_is_the_numpy_one(c, data):
    plan_, copies, _ = _one_view_case(c, data)
    for to_host in (True, False):
        ours = plan.copy_list(plan_, copies, to_host=to_host)
        table = plan._one_view(plan_, copies, to_host, {})
        expected = table if table is not None else np.zeros((3, 0), dtype=np.int64)
        assert np.array_equal(ours.table, expected)
        if ours.count:
            assert ours.address == ours.table.ctypes.data  # what the driver is handed is the table


def test_block_ids_of_any_integer_sequence_and_clear_errors_for_anything_else():
    pool = torch.zeros(10, 8, dtype=torch.uint8)
    arena = torch.zeros(4 * 8, dtype=torch.uint8)
    plan_ = make_plan([pool])
    for ids in ([3, 4], (3, 4), np.array([3, 4]), range(3, 5)):
        listing = plan.copy_list(plan_, [ChunkCopy(ids, arena)], to_host=True)
        assert _rows(listing) == [(arena.data_ptr(), pool.data_ptr() + 24, 16)]
    with pytest.raises(TypeError):
        plan.copy_list(plan_, [ChunkCopy([3, "4"], arena)], to_host=True)
    with pytest.raises(OverflowError, match="64 bits"):
        plan.copy_list(plan_, [ChunkCopy([1 << 60], arena)], to_host=True)
    with pytest.raises(OverflowError):
        plan.copy_list(plan_, [ChunkCopy([1 << 70], arena)], to_host=True)
    with pytest.raises(AttributeError):
        plan.copy_list(plan_, [object()], to_host=True)
    with pytest.raises(ValueError, match="seg must be > 0"):
        NATIVE.list_one_view(0, 8, 0, [], True, 1, 1)


@pytest.mark.parametrize("c_helper", [True, False])
def test_a_given_span_is_what_the_lists_use(monkeypatch, c_helper):
    """A chunk part's ``span`` (the host tier's note of its slot) stands for torch's answer, in
    both listers: the addresses listed, the allocation met, and the parts left, which keep it."""
    monkeypatch.setattr(native, "NATIVE", NATIVE if c_helper else None)
    pool = torch.zeros(10, 8, dtype=torch.uint8)
    arena = torch.zeros(4 * 8, dtype=torch.uint8)
    plan_ = make_plan([pool])
    given = ChunkCopy([3, 4, 6], arena, 1, (1 << 20, 1 << 19))  # not where torch would say
    listing = plan.copy_list(plan_, [given], to_host=True)
    assert _rows(listing) == [((1 << 20) + 8, pool.data_ptr() + 24, 16), ((1 << 20) + 24, pool.data_ptr() + 48, 8)]
    assert list(listing.hosts) == [1 << 19]
    head, taken, rest = plan.head_list(plan_, [given], to_host=False, max_bytes=8, max_copies=4)
    assert _rows(head) == [(pool.data_ptr() + 24, (1 << 20) + 8, 8)] and taken == 8
    assert [(list(c.block_ids), c.first, c.span) for c in rest] == [([4, 6], 2, (1 << 20, 1 << 19))]
    asked = ChunkCopy([3], arena)
    assert _rows(plan.copy_list(plan_, [asked], to_host=True)) == [(arena.data_ptr(), pool.data_ptr() + 24, 8)]


def test_a_span_that_is_not_two_ints_is_a_clear_error():
    arena = torch.zeros(4 * 8, dtype=torch.uint8)
    for span in ((1,), [1, 2], "ab", (1, 2, 3)):
        with pytest.raises(TypeError, match="span must be None or"):
            NATIVE.list_one_view(0, 8, 8, [ChunkCopy([1], arena, 0, span)], True, 64, 4)
    with pytest.raises(TypeError):
        NATIVE.list_one_view(0, 8, 8, [ChunkCopy([1], arena, 0, (1, "x"))], True, 64, 4)
    with pytest.raises(OverflowError):
        NATIVE.list_one_view(0, 8, 8, [ChunkCopy([1], arena, 0, (1 << 64, 0))], True, 64, 4)


def test_no_reference_is_kept_or_lost():
    """Every object the helper touches has the reference count it had before, after thousands of
    calls, stopped mid-chunk, run to the end, and failed."""
    pool = torch.zeros(64, 8, dtype=torch.uint8)
    plan_ = make_plan([pool])
    hosts = [torch.zeros(16 * 8, dtype=torch.uint8) for _ in range(3)]
    ids = [list(range(k, 64, 4))[:16] for k in range(3)]
    spans = [None, (hosts[1].data_ptr(), hosts[1].untyped_storage().data_ptr()), None]
    copies = [ChunkCopy(i, h, 0, s) for i, h, s in zip(ids, hosts, spans, strict=True)]
    bad = [ChunkCopy([1, "x"], hosts[0]), ChunkCopy([1], hosts[2], 0, (1,))]
    watched = [*hosts, *ids, spans[1], copies, *copies, *bad, bad]
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(2000):
        NATIVE.list_one_view(*plan_.first, copies, True, 5 * 8, 4)
        NATIVE.list_one_view(*plan_.first, copies, False, 1 << 40, 1 << 20)
        for k in range(len(bad)):
            with pytest.raises(TypeError):
                NATIVE.list_one_view(*plan_.first, bad[k : k + 1], True, 1 << 40, 1 << 20)
    assert [sys.getrefcount(o) for o in watched] == before


_BATCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_NAME = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
_ERROR = b"CUDA_ERROR_PLAYED"  # alive as long as the module: the driver's names are static strings


@pytest.mark.parametrize("c_helper", [True, False])
def test_the_driver_gets_the_same_call_through_the_helper_as_through_ctypes(monkeypatch, c_helper):
    """A stand-in for ``cuMemcpyBatchAsync_v2`` (a C-callable Python function) sees the window's
    copies, count, attributes and stream; a refusal's CUresult becomes a RuntimeError naming it."""
    seen = []

    def batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream):
        row = lambda at: [ctypes.c_int64.from_address(at + 8 * k).value for k in range(count)]  # noqa: E731
        seen.append((row(dsts), row(srcs), row(sizes), attrs, idxs, num_attrs, stream))
        return 0 if len(seen) == 1 else 1

    def name(rc, out):
        out[0] = _ERROR
        return 0

    fn, error_name = _BATCH(batch), _NAME(name)
    monkeypatch.setattr(cuda_batch, "_driver", lambda: (fn, error_name, ctypes.cast(fn, ctypes.c_void_p).value))
    monkeypatch.setattr(native, "NATIVE", NATIVE if c_helper else None)
    listing = CopyList(np.array([[10, 11, 12], [20, 21, 22], [5, 6, 7]], dtype=np.int64))
    cuda_batch.memcpy_batch(listing, 1, 3, 99)
    assert seen == [([11, 12], [21, 22], [6, 7], *cuda_batch._ARGS, 1, 99)]
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_PLAYED \(1\)"):
        cuda_batch.memcpy_batch(listing, 0, 1, 99)


def test_other_threads_run_python_while_the_driver_call_runs():
    """The driver spends host time per copy; the engine's step loop must not wait for it behind
    the GIL (the ctypes call released it too). libc's ``usleep`` stands in for the driver: its
    first argument is the sleep, the rest are ignored by the C calling convention. A thread
    beside it notes its longest pause between two turns of a loop: 200 ms if the call held the
    GIL throughout."""
    usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
    longest, done = [0.0], threading.Event()

    def loop():
        last = time.monotonic()
        while not done.is_set():
            now = time.monotonic()
            longest[0], last = max(longest[0], now - last), now

    beside = threading.Thread(target=loop)
    beside.start()
    try:
        time.sleep(0.01)
        assert NATIVE.batch_call(usleep, 200_000, 0, 0, 0, 0, 0, 0, 0) == 0
    finally:
        done.set()
        beside.join()
    assert longest[0] < 0.15, longest


def test_the_plan_uses_the_helper_where_it_is_built(monkeypatch):
    """The switch is the module attribute: with it cleared, the same calls give the Python lists."""
    pool = torch.zeros(10, 8, dtype=torch.uint8)
    arena = torch.zeros(4 * 8, dtype=torch.uint8)
    plan_, copies = make_plan([pool]), [ChunkCopy([3, 4, 7], arena)]
    listing, _, _ = plan.head_list(plan_, copies, to_host=True, max_bytes=1 << 20, max_copies=16)
    assert isinstance(listing._raw, bytes)  # the helper's table
    monkeypatch.setattr(native, "NATIVE", None)
    python, _, _ = plan.head_list(plan_, copies, to_host=True, max_bytes=1 << 20, max_copies=16)
    assert not isinstance(python._raw, bytes) and _rows(python) == _rows(listing)
