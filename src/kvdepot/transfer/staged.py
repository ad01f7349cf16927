"""Block moves through device staging buffers: gather kernels + large PCIe copies, pipelined.

Per-run copies (``TorchBlockMover``) run each block as its own DMA. That is near the PCIe
ceiling for multi-MiB blocks, but small blocks lose bandwidth per copy (measured on the H200:
64 KiB copies reach ~9 GB/s, 256 KiB ~36, 2 MiB ~51 of ~55). Here a store gathers the blocks on
the GPU into a contiguous staging window (``index_select`` at device-memory speed, ~50x PCIe)
and moves it to the host slots with as few copies as the slots' memory allows (adjacent slots
are one copy); a load does the reverse with ``index_copy_``.

A batch (``*_many``) uploads its block ids once and walks the chunks in windows of at most
``window_bytes``. Each caller stream has a *lane*: two staging windows and a copy stream, so
the gather (or scatter) kernel of one window runs on the caller's stream while the previous
window's PCIe copy runs on the lane's copy stream — the kernels hide behind the copies instead
of adding to them (measured before pipelining: ~4% of a 4 MiB-block store). Events keep each
window's reuse ordered, and the caller's stream waits for the lane at the end, so callers see
the same contract as a single-stream mover: the move is complete when their stream reaches it.

CPU pools fall back to the per-run mover (there is no PCIe to amortize).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvdepot.transfer.base import ChunkCopy, OneChunk, view_regions, windows
from kvdepot.transfer.torch_mover import TorchBlockMover

_WORDS = (torch.int64, torch.int32, torch.int16)
WINDOW_BYTES = 64 << 20  # one staging window; a lane holds two (larger chunks get a larger window)


def _window_copies(views: Sequence[torch.Tensor], window: list[ChunkCopy], staging: torch.Tensor) -> list:
    """The (host bytes, staging bytes) pairs to copy for a window, 1-D both: per view, one per run
    of chunks whose parts lie back to back in one host allocation (adjacent arena slots: one
    larger copy instead of several). Staging is view-major over the window's blocks, so one
    view's rows of consecutive chunks are adjacent there by construction.

    Adjacency is worked out on byte offsets, and tensors are made only for the merged runs: at
    32 small chunks per operation, a tensor per chunk and view was most of the host time."""
    segs = [v.shape[1] for v in views]
    per_block, total = sum(segs), sum(len(c.block_ids) for c in window)
    chunks = [(c, c.host.untyped_storage(), c.host.numel() // per_block) for c in window]
    pairs, prefix = [], 0
    for seg in segs:
        stage_at = prefix * total  # this view's region of the staging window
        run: list | None = None  # [storage, host offset in storage, bytes, staging offset]
        for c, storage, slot_blocks in chunks:
            at = c.host.storage_offset() + prefix * slot_blocks + c.first * seg
            size = len(c.block_ids) * seg
            if run is not None and run[0].data_ptr() == storage.data_ptr() and run[1] + run[2] == at:
                run[2] += size
            else:
                if run is not None:
                    pairs.append(_pair(run, staging))
                run = [storage, at, size, stage_at]
            stage_at += size
        if run is not None:
            pairs.append(_pair(run, staging))
        prefix += seg
    return pairs


def _pair(run: list, staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    storage, at, size, stage_at = run
    host = torch.empty(0, dtype=torch.uint8).set_(storage, at, (size,))
    return host, staging[stage_at : stage_at + size]


def _as_words(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """View 2-D uint8 tensors with the widest integer type *all* of them allow (fewer elements to
    index). One type for source and destination: a pool view and its staging region can differ in
    alignment (views of unequal widths), and an ``index_select`` whose ``out`` has another width
    does not fail — it resizes ``out`` into new memory and the staging window keeps stale bytes."""
    for dtype in _WORDS:
        size = dtype.itemsize
        if all(t.shape[-1] % size == 0 and t.stride(0) % size == 0 and t.data_ptr() % size == 0 for t in tensors):
            return [t.view(dtype) for t in tensors]
    return list(tensors)


@dataclass
class _Lane:
    """One caller stream's staging: two windows used in turn, and the stream their copies run on."""

    copy: torch.cuda.Stream
    windows: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    free: list[torch.cuda.Event | None] = field(default_factory=lambda: [None, None])  # window reusable after

    def window(self, i: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self.windows[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            buf.record_stream(self.copy)  # freed (on growth) only after the copy stream is done with it
            self.windows[i] = buf
        return buf[:nbytes]


class StagedBlockMover(OneChunk):
    """Gather/scatter on the device, large host<->device copies, the two overlapped."""

    def __init__(self, window_bytes: int = WINDOW_BYTES) -> None:
        self.window_bytes = window_bytes
        self._fallback = TorchBlockMover()
        self._lanes: dict[tuple[torch.device, int], _Lane] = {}

    def gather_many(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> None:
        if not views[0].is_cuda:
            return self._fallback.gather_many(views, copies)
        self._move(views, copies, to_host=True)

    def scatter_many(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor]) -> None:
        if not views[0].is_cuda:
            return self._fallback.scatter_many(copies, views)
        self._move(views, copies, to_host=False)

    def _move(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy], *, to_host: bool) -> None:
        device = views[0].device
        caller = torch.cuda.current_stream(device)
        lane = self._lane(device, caller)
        per_block = sum(v.shape[1] for v in views)
        index = self._index([b for c in copies for b in c.block_ids], device)  # one upload per batch
        start = 0
        for w, window in enumerate(windows(copies, per_block, self.window_bytes)):
            i, n = w % 2, sum(len(c.block_ids) for c in window)
            staging = lane.window(i, n * per_block, device)
            idx, start = index[start : start + n], start + n
            pairs = _window_copies(views, window, staging)
            if to_host:
                if lane.free[i] is not None:
                    caller.wait_event(lane.free[i])  # the window's previous copy has left it
                for view, region in view_regions(views, staging):
                    source, out = _as_words(view, region)
                    torch.index_select(source, 0, idx, out=out)
                lane.copy.wait_stream(caller)
                with torch.cuda.stream(lane.copy):
                    for host, stage in pairs:
                        host.copy_(stage, non_blocking=True)
                lane.free[i] = lane.copy.record_event()
            else:
                if lane.free[i] is not None:
                    lane.copy.wait_event(lane.free[i])  # the window's previous scatter has read it
                with torch.cuda.stream(lane.copy):
                    for host, stage in pairs:
                        stage.copy_(host, non_blocking=True)
                caller.wait_stream(lane.copy)
                for view, region in view_regions(views, staging):
                    target, source = _as_words(view, region)
                    target.index_copy_(0, idx, source)
                lane.free[i] = caller.record_event()
        if to_host:
            caller.wait_stream(lane.copy)  # the caller's stream completes when the copies do

    def _lane(self, device: torch.device, caller: torch.cuda.Stream) -> _Lane:
        key = (device, caller.stream_id)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(torch.cuda.Stream(device))
        return lane

    @staticmethod
    def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        host = torch.tensor(block_ids, dtype=torch.long).pin_memory()
        return host.to(device, non_blocking=True)
