"""Block moves as one DMA per run of adjacent blocks, handed to the driver a window at a time.

The per-run mover (``runs``) issues each copy from Python; the staged mover gathers blocks into
a device window first so that it has few copies to issue. This mover lists every copy's
addresses (the pool's side fixed at registration, ``plan.PoolPlan``), merges blocks that are
adjacent in both the pool and the host buffer into one copy, and enqueues a window's copies with
a single ``cuMemcpyBatchAsync`` (``cuda_batch``). No staging memory, no kernels, no SMs: copy
engines only.

Windows keep the copy engines fed while later windows are listed and handed over. In a
cross-layer pool (TensorRT-LLM's; one view) the first 64 MiB are listed in plain Python a window
at a time (``plan.head_list``: 16 copies, then 32 at a time), each enqueued before the next is
listed, so that the engines start after a few blocks' worth of host work; the rest is listed
with numpy (``plan.copy_list``) in windows doubling up to 64 MiB (``window_bounds``). Why Python
first: an operation on a GPU host starts with the CPU caches swept by the last one's DMA, where
each numpy call costs 5-15x its hot-loop time (issue 19, docs/perf-notes.md). Measured on the
H200 (perf-notes, runs O, Q and Y-AD): the best mover from 256 KiB blocks up, with no SMs
taken from the forward; ``auto`` picks it wherever the driver has the call. ``scatter_layers``
loads a cross-layer pool one layer at a time, for TensorRT-LLM's ``wait_for_layer_load``.

A store is prepared as a ``Move`` (``prepare_gather``): the engine's calling thread enqueues its
first windows (``head``, a few MiB) and only then hands it to its store issuer, which enqueues
the rest (``rest``) — the copy engines start without waiting for a sleeping thread to wake, and
they have the head to copy while it does (``inflight.py``). ``lanes`` > 1 alternates windows over that many
streams (the caller's and lanes joined back into it): an experiment in letting two copy engines
overlap each copy's fixed cost, for small copies (issue 19; ``kvdepot bench transfer --lanes``).

Falls back to the per-run torch copies where the batch call cannot be used: CPU pools, a caller
on the legacy default stream, host buffers that are not pinned (torch copies those correctly,
synchronously), and any move the driver refuses part of (logged and counted in ``refused``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvdepot.transfer.base import ChunkCopy, OneChunk
from kvdepot.transfer.cuda_batch import CUDA_DRIVER, BatchDriver
from kvdepot.transfer.plan import CopyList, PoolPlan, block_addresses, copy_list, head_list, plan_of
from kvdepot.transfer.torch_mover import TorchBlockMover

WINDOW_BYTES = 64 << 20
FIRST_WINDOW_BYTES = 2 << 20
EARLY_BYTES = 64 << 20  # how much of a one-view move is listed in Python (``plan.head_list``) ...
# ... in windows of at most 16 copies, then 32, 32, ... (and ``window_bytes``). Each call costs the
# host ~10 us or more cold on an H100's host; fewer, larger first windows won where 4, 8, 16 had
# been tuned on the H200 (issue 19, ninth pass: 256 KiB stores +4 points against 4 first, 1 MiB
# and 4 MiB unchanged; 32 first was no better for a store and 1.4 points worse at 1 MiB).
EARLY_COPIES = (16, 32)
logger = logging.getLogger("kvdepot")


def window_bounds(sizes: np.ndarray, window_bytes: int, first_bytes: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` slices of the copies: the first about ``first_bytes``, each next
    one twice the last, up to ``window_bytes`` each. A copy belongs to the window its last byte
    falls in (so a copy larger than a window ends one).

    Why growing: the copy engines start on a window only once its driver call has returned, and
    the call costs ~0.5-1.7 us of host time per copy (H200 host, run P: a 64 MiB window of 256 KiB
    blocks kept the engines idle ~0.5 ms at the start of every move; run Q, growing: 1B-shape
    stores 0.75 -> 0.84 of memcpy, loads 0.81 -> 0.90). A small first window starts
    them at once; each next window is issued while the previous, half its size, is copied, and a
    copy takes longer than its issue (~4.7 us for 256 KiB at PCIe speed)."""
    return _bounds(np.cumsum(sizes), window_bytes, first_bytes)


def _bounds(ends: np.ndarray, window_bytes: int, first_bytes: int | None) -> list[tuple[int, int]]:
    """``window_bounds`` of copies ending at ``ends`` bytes from the start of the move."""
    if not len(ends):
        return []
    total = int(ends[-1])
    edges, edge, step = [], 0, min(first_bytes or window_bytes, window_bytes)  # where windows end
    while edge < total:
        edge += step
        edges.append(edge)
        step = min(2 * step, window_bytes)
    out, lo = [], 0
    for hi in np.searchsorted(ends, edges, side="right").tolist():  # copies ending by each edge
        if hi > lo:
            out.append((lo, hi))
            lo = hi
    if lo < len(ends):
        out.append((lo, len(ends)))
    return out


class BatchBlockMover(OneChunk):
    """Per-run DMA copies, a window's worth per driver call."""

    copies_by_layer = True

    def __init__(self, window_bytes: int = WINDOW_BYTES, first_window_bytes: int | None = FIRST_WINDOW_BYTES, *,
                 lanes: int = 1, early_bytes: int = EARLY_BYTES, driver: BatchDriver = CUDA_DRIVER) -> None:
        """``first_window_bytes``: the first window's size (doubling up to ``window_bytes``); None:
        all equal. ``early_bytes``: how much of a one-view move is listed in Python, a window at a
        time (16 copies, then twice as many each time up to 32), before the rest of its copy list
        (0: none).
        ``lanes``: streams a move's windows alternate on (config ``transfer_lanes``).
        ``driver``: the device's side of it (``cuda_batch.CudaDriver``; tests and CPU benches pass
        another)."""
        if lanes < 1:
            raise ValueError(f"lanes={lanes} must be >= 1")
        self.window_bytes = window_bytes
        self.first_window_bytes = first_window_bytes
        self.early_bytes = early_bytes
        self.lanes = lanes
        self.driver = driver
        self.refused = 0  # batches the driver refused (each then copied by torch)
        self._fallback = TorchBlockMover()

    def gather_many(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> None:
        _BatchMove(self, views, copies, to_host=True).rest()

    def scatter_many(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor]) -> None:
        _BatchMove(self, views, copies, to_host=False).rest()

    def prepare_gather(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> _BatchMove:
        """A store whose windows the caller may start (``head``) and the issuer finishes (``rest``)."""
        return _BatchMove(self, views, copies, to_host=True)

    def scatter_layers(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor], num_layers: int) -> Iterator[int]:
        """A load in layer order, one layer per step: each ``next()`` enqueues layer ``l`` of every
        block on the *current* stream and yields ``l`` — so that the forward over layer 0 can
        start while later layers are still copied, and the caller can enqueue later layers when
        it likes (``layered.LayeredLoad``: a helper thread, or the forward's waits).

        Only for a cross-layer pool (one view whose rows are ``num_layers`` equal parts, layer
        ``l`` the ``l``-th: TensorRT-LLM's ``[block, layer, k|v, …]``); the host rows hold the
        same bytes in the same order, so layer ``l`` of a block is one copy at the same offset on
        both sides. One driver call per layer, every block's part in it, on one stream (lanes are
        for whole moves). Anything else, or a call the driver refuses, moves whole at that step
        (torch copies of the same bytes; a layer already copied gets them again), and the
        remaining steps enqueue nothing."""
        layer = 0
        plan = plan_of(views)
        # Every step enqueues on the stream current at the first (``LayeredLoad`` keeps one side stream).
        stream = self.driver.stream(views) if plan is not None and plan.views == 1 else None
        if stream is not None and not self.driver.pinned(_hosts(copies)):
            stream = None
        if stream is not None and plan is not None and int(plan.seg[0]) % num_layers == 0:
            pool, host = block_addresses(plan, copies)
            table = np.empty((3, len(pool)), dtype=np.int64)
            table[0], table[1], table[2] = pool, host, int(plan.seg[0]) // num_layers
            parts = CopyList(table)
            try:
                for layer in range(num_layers):  # after a refusal, ``layer`` is the one not yielded
                    self.driver.copy(parts, 0, parts.count, stream)
                    table[:2] += table[2, 0]  # the next layer's parts (the driver has read this call's)
                    yield layer
                return
            except RuntimeError as exc:
                self._refused(exc)
        self._fallback.scatter_many(copies, views)
        yield from range(layer, num_layers)

    def _refused(self, exc: RuntimeError) -> None:
        """A batch the driver refused: never a lost store or a load that leaves garbage in the
        pool (TensorRT-LLM has no way to hear of a failed load); loud, and counted."""
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            logger.warning("kvdepot: the driver refused a batched copy (%s); copied with torch instead "
                           "(%d refused so far)", exc, self.refused)


def _hosts(copies: Sequence[ChunkCopy]) -> dict[int, torch.Tensor]:
    """``copies``' host allocations, each with a buffer in it (for ``BatchDriver.pinned``)."""
    return {c.addresses()[1]: c.host for c in copies}


class _BatchMove:
    """One gather or scatter, enqueued window by window: all by one thread, or a store's by two
    in turn — the engine's caller enqueues the first windows (``head``), then hands the store
    to its issuer thread, which enqueues the others (``rest``). Never both at once: the issuer
    is woken only after the head has returned, so neither waits for the GIL behind the other
    within the call (a thread back from a driver call rarely wins the GIL from a busy one).

    The first windows of a one-view move (up to ``early_bytes``, 64 MiB) are built in plain
    Python (``plan.head_list``), each enqueued before the next is built, and the rest of the copy
    list with numpy after them. The copy engines start after 16 blocks' worth of host work, and
    each window is listed while the one before it copies (H200, issue 19: a numpy list of 256
    blocks took 120-150 us after the engines had started, and they sat idle for it).

    A window the driver refuses stops the move, and ``rest`` moves it all again with torch: the
    driver checks a batch before it runs any of it, and a block copied twice gets the same bytes."""

    def __init__(self, mover: BatchBlockMover, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy], *,
                 to_host: bool) -> None:
        self._mover, self._views, self._copies, self._to_host = mover, views, copies, to_host
        self._started = False
        self._stream: Any = None  # where the windows go (None: torch copies in ``rest``)
        self._plan: PoolPlan | None = None
        self._lanes: list[Any] = []  # the stream, then the lanes windows alternate on
        self._windows: list[tuple[CopyList, int, int, int]] = []  # list, lo, hi, bytes of the move through it
        self._unlisted: Sequence[ChunkCopy] | None = None  # chunk parts whose copy list is not built yet
        self._next = 0  # the next window to enqueue
        self._step = 0  # early windows listed by this thread: 16 copies, then 32
        self._checked: set[int] = set()  # host allocations the driver may copy
        self._by_torch = False  # part of the move cannot go through the batch call: torch copies it all
        self._refusal: RuntimeError | None = None
        self._error: BaseException | None = None  # what ``head`` could not do, raised by ``rest``

    def head(self, max_bytes: int) -> None:
        try:
            self._start()
            while self._window_left(max_bytes) and (not self._next or self._windows[self._next][3] <= max_bytes):
                self._enqueue()
        except BaseException as exc:  # NOTE: a thread boundary: ``rest`` raises it on the issuer
            self._error = exc

    def rest(self) -> None:
        if self._error is not None:
            raise self._error
        self._step = 0  # a store's issuer, just woken, starts small again: the engines may be idle
        try:
            self._start()
            while self._window_left():
                self._enqueue()
        finally:
            for lane in self._lanes[1:]:  # the move's stream ends after every lane's windows
                self._mover.driver.join(self._stream, lane)
        if self._stream is None or self._refusal is not None or self._by_torch:
            if self._refusal is not None:
                self._mover._refused(self._refusal)
            fallback = self._mover._fallback
            if self._to_host:
                fallback.gather_many(self._views, self._copies)
            else:
                fallback.scatter_many(self._copies, self._views)

    def _start(self) -> None:
        """The stream, once (None: torch copies it all in ``rest``)."""
        if self._started:
            return
        self._started = True
        plan = plan_of(self._views)
        stream = self._mover.driver.stream(self._views) if plan is not None else None
        if stream is not None and plan is not None:
            self._stream, self._plan, self._lanes, self._unlisted = stream, plan, [stream], self._copies

    def _window_left(self, limit: int | None = None) -> bool:
        """Whether a window is left to enqueue. Windows are listed as they are needed: first in
        Python (one view: 16 copies, then 32 at a time up to ``early_bytes``), each
        enqueued before the next is built, then the rest of the move at once with numpy. At most
        32 copies, because whoever lists the next window (a store's issuer, just woken) leaves the
        copy engines idle until its first call returns: a window of 128 256 KiB blocks took
        ~240 us to list and hand over on the H200's host, 32 take ~60 and copy for ~150. (A cap
        of 16, tried in run AM for the host's slow phases, read 1-3 points lower at 256 KiB.)"""
        if self._next == len(self._windows) and self._unlisted and not self._by_torch and self._refusal is None:
            done = self._windows[-1][3] if self._windows else 0
            if limit is not None and done and done >= limit:
                return False  # a head stops here, listing nothing more for the issuer
            if done < self._mover.early_bytes and self._plan.views == 1:  # type: ignore[union-attr]
                room = (self._mover.early_bytes if limit is None or not done else min(limit, self._mover.early_bytes)) - done
                self._list_early(min(EARLY_COPIES[0] << self._step, EARLY_COPIES[1]), done, room)
                self._step += 1
            else:
                self._list_rest(done)
        return self._next < len(self._windows) and not self._by_torch and self._refusal is None

    def _list_early(self, copies: int, done: int, room: int) -> None:
        mover = self._mover
        room = min(room, mover.window_bytes)
        listing, taken, self._unlisted = head_list(self._plan, self._unlisted, to_host=self._to_host,  # type: ignore[arg-type]
                                                   max_bytes=room, max_copies=copies)
        if listing.count and self._pinned(listing):
            self._windows.append((listing, 0, listing.count, done + taken))

    def _list_rest(self, done: int) -> None:
        mover, copies, self._unlisted = self._mover, self._unlisted, None
        listing = copy_list(self._plan, copies, to_host=self._to_host)  # type: ignore[arg-type]
        if not listing.count or not self._pinned(listing):
            return
        # Growing on from the last early window's size (equal windows stay equal).
        last = done - (self._windows[-2][3] if len(self._windows) > 1 else 0)
        first = 2 * last if done and mover.first_window_bytes is not None else mover.first_window_bytes
        for lo, hi in _bounds(listing.ends, mover.window_bytes, first):
            self._windows.append((listing, lo, hi, done + int(listing.ends[hi - 1])))
        wanted = min(mover.lanes, len(self._windows) - self._next)
        self._lanes += [mover.driver.lane(self._stream) for _ in range(wanted - len(self._lanes))]

    def _pinned(self, listing: CopyList) -> bool:
        """Whether the driver may copy ``listing``'s host buffers (each allocation asked once per
        move); if not, torch copies the whole move (``rest``)."""
        fresh = {alloc: h for alloc, h in listing.hosts.items() if alloc not in self._checked}
        if fresh and not self._mover.driver.pinned(fresh):
            self._by_torch = True
            return False
        self._checked.update(fresh)
        return True

    def _enqueue(self) -> None:
        """The next window, on its stream (the move's and its lanes in turn)."""
        listing, lo, hi, _ = self._windows[self._next]
        stream = self._lanes[self._next % len(self._lanes)]
        self._next += 1
        try:
            self._mover.driver.copy(listing, lo, hi, stream)
        except RuntimeError as exc:
            self._refusal = exc
