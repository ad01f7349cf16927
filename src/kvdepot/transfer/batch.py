"""Block moves as one DMA per run of adjacent blocks, handed to the driver a window at a time.

The per-run mover (``runs``) issues each copy from Python; the staged mover gathers blocks into
a device window first so that it has few copies to issue. This mover builds every copy's
addresses with numpy (``base.block_addresses``), merges blocks that are adjacent in both the
pool and the host buffer into one copy, and enqueues a window's copies with a single
``cuMemcpyBatchAsync`` (``cuda_batch``). No staging memory, no kernels, no SMs: copy engines only.

Windows keep the first copies running while later windows are handed over: the first is small
(2 MiB) so that the copy engines start at once, and they double up to 64 MiB (``window_bounds``).
Measured on the H200 (perf-notes, runs O and Q): the best mover from 256 KiB blocks up, with no SMs
taken from the forward; ``auto`` picks it wherever the driver has the call. ``scatter_layers``
loads a cross-layer pool one layer at a time, for TensorRT-LLM's ``wait_for_layer_load``.

Falls back to the per-run torch copies where the batch call cannot be used: CPU pools, a caller
on the legacy default stream, host buffers that are not pinned (torch copies those correctly,
synchronously), and any move the driver refuses part of (logged and counted in ``refused``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvdepot.transfer import cuda_batch
from kvdepot.transfer.base import ChunkCopy, OneChunk, block_addresses
from kvdepot.transfer.torch_mover import TorchBlockMover

WINDOW_BYTES = 64 << 20
FIRST_WINDOW_BYTES = 2 << 20
logger = logging.getLogger("kvdepot")


def copy_runs(views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pool addresses, host addresses, sizes)``: one entry per maximal run of listed block
    segments that follow each other both in the pool and in the host buffers (one contiguous
    span on each side), over all views in order.

    A run never crosses from one allocation into another, even where two lie back to back in
    the address space (pinned arena segments often do): the driver refuses such a copy
    (CUDA_ERROR_INVALID_VALUE, seen on the H200 as dropped stores in the MP server)."""
    parts = []
    for v, (seg, pool, host, host_alloc) in enumerate(block_addresses(views, copies)):
        pool_alloc = np.full(len(pool), views[v].untyped_storage().data_ptr(), dtype=np.int64)
        parts.append((pool, host, np.full(len(pool), seg, dtype=np.int64), pool_alloc, host_alloc))
    pool, host, size, pool_alloc, host_alloc = (np.concatenate(column) for column in zip(*parts, strict=True))
    if not len(pool):
        return pool, host, size
    breaks = np.flatnonzero((pool[:-1] + size[:-1] != pool[1:]) | (host[:-1] + size[:-1] != host[1:])
                            | (pool_alloc[:-1] != pool_alloc[1:]) | (host_alloc[:-1] != host_alloc[1:])) + 1
    starts = np.concatenate(([0], breaks))
    return pool[starts], host[starts], np.add.reduceat(size, starts)


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
    if not len(sizes):
        return []
    first = min(first_bytes or window_bytes, window_bytes)
    ends = np.cumsum(sizes) - 1  # each copy's last byte, counted from the start of the move
    edges, edge, step = [], 0, first  # cumulative byte offsets at which windows end
    while edge <= ends[-1]:
        edge += step
        edges.append(edge)
        step = min(2 * step, window_bytes)
    window = np.searchsorted(np.asarray(edges, dtype=np.int64), ends, side="right")
    starts = np.concatenate(([0], np.flatnonzero(np.diff(window)) + 1, [len(sizes)]))
    return [(int(lo), int(hi)) for lo, hi in zip(starts[:-1], starts[1:], strict=True)]


class BatchBlockMover(OneChunk):
    """Per-run DMA copies, a window's worth per driver call."""

    copies_by_layer = True

    def __init__(self, window_bytes: int = WINDOW_BYTES, first_window_bytes: int | None = FIRST_WINDOW_BYTES) -> None:
        """``first_window_bytes``: the first window's size (doubling up to ``window_bytes``); None: all equal."""
        self.window_bytes = window_bytes
        self.first_window_bytes = first_window_bytes
        self.refused = 0  # batches the driver refused (each then copied by torch)
        self._fallback = TorchBlockMover()

    def gather_many(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> None:
        self._move(views, copies, to_host=True)

    def scatter_many(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor]) -> None:
        self._move(views, copies, to_host=False)

    def _move(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy], *, to_host: bool) -> None:
        stream = self._stream(views, copies)
        if stream is not None:
            # Addresses for the whole batch in one pass, then one driver call per window: built
            # window by window they cost 2-8x the host time (numpy's per-call overhead, 16
            # windows per GiB at 4 MiB blocks), and a store and a load share one GIL.
            pool, host, sizes = copy_runs(views, copies)
            src, dst = (pool, host) if to_host else (host, pool)
            try:
                for lo, hi in window_bounds(sizes, self.window_bytes, self.first_window_bytes):
                    cuda_batch.memcpy_batch(dst[lo:hi], src[lo:hi], sizes[lo:hi], stream)
                return
            except RuntimeError as exc:
                self._refused(exc)
        # Per-run torch copies of the same bytes on the same stream. Also after a refused batch:
        # the driver checks a batch before it runs any of it, and a block copied twice gets the
        # same bytes, so the whole move is simply done again, the slow way.
        if to_host:
            self._fallback.gather_many(views, copies)
        else:
            self._fallback.scatter_many(copies, views)

    def scatter_layers(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor], num_layers: int) -> Iterator[int]:
        """A load in layer order, one layer per step: each ``next()`` enqueues layer ``l`` of every
        block on the *current* stream and yields ``l`` — so that the forward over layer 0 can
        start while later layers are still copied, and the caller can enqueue later layers when
        it likes (``inflight.LayeredLoad``: a few layers ahead of the forward).

        Only for a cross-layer pool (one view whose rows are ``num_layers`` equal parts, layer
        ``l`` the ``l``-th: TensorRT-LLM's ``[block, layer, k|v, …]``); the host rows hold the
        same bytes in the same order, so layer ``l`` of a block is one copy at the same offset on
        both sides. One driver call per layer, every block's part in it. Anything else, or a call
        the driver refuses, moves whole at that step (torch copies of the same bytes; a layer
        already copied gets them again), and the remaining steps enqueue nothing."""
        layer = 0
        stream = self._stream(views, copies)  # every step enqueues here (``LayeredLoad`` keeps one side stream)
        if stream is not None and len(views) == 1 and views[0].shape[1] % num_layers == 0:
            ((seg, pool, host, _alloc),) = block_addresses(views, copies)
            part = seg // num_layers
            sizes = np.full(len(pool), part, dtype=np.int64)
            try:
                for layer in range(num_layers):  # after a refusal, ``layer`` is the one not yielded
                    cuda_batch.memcpy_batch(pool + layer * part, host + layer * part, sizes, stream)
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

    @staticmethod
    def _stream(views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> int | None:
        """The current stream's handle when the batch call can serve this move, else None."""
        if not views or not views[0].is_cuda or not cuda_batch.available():
            return None
        stream = torch.cuda.current_stream(views[0].device).cuda_stream
        if stream == 0 or not _all_pinned(copies):
            return None
        return stream


def _all_pinned(copies: Sequence[ChunkCopy]) -> bool:
    seen: set[int] = set()
    for c in copies:
        storage = c.host.untyped_storage().data_ptr()
        if storage not in seen:
            if c.host.is_cuda or not c.host.is_pinned():
                return False
            seen.add(storage)
    return True
