"""Block moves with plain torch ops: works for CPU and CUDA pools and every dtype (bytes only).

One ``copy_`` per run of consecutive block ids and view, between the pool and the host
buffer: a memcpy on CPU, a ``cudaMemcpyAsync`` (non-blocking, pinned host memory) on the
caller's current stream on CUDA. (``index_select`` on byte tensors copies element by element
on CPU and measured 6x slower than per-run memcpy.) TensorRT-LLM blocks are multi-MiB and contiguous
across layers, so a copy per run is already near the DMA ceiling for large models; small
blocks are where the staged mover's gather kernel pays.

Copies are issued one by one from Python (7.3 us each on the H200's host, perf-notes run F),
so the first copy starts at once and the rest are issued while the DMA runs. Batching them into
one ``torch._foreach_copy_`` saved only 1.2 us per copy but started the first copy after all were
prepared: the 4 MiB-block store fell from 0.947 to 0.905 of memcpy (perf-notes, run F).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdepot.transfer.base import PerChunk, block_runs, view_regions


class TorchBlockMover(PerChunk):
    """The reference mover: correct on every device, fast for large blocks on CUDA."""

    def gather(
        self, views: Sequence[torch.Tensor], block_ids: Sequence[int], dst: torch.Tensor, first: int = 0
    ) -> None:
        if not block_ids:
            return
        runs = block_runs(block_ids)
        for view, region in view_regions(views, dst):
            for pos, bid, length in runs:
                region[first + pos : first + pos + length].copy_(view[bid : bid + length], non_blocking=True)

    def scatter(
        self, src: torch.Tensor, views: Sequence[torch.Tensor], block_ids: Sequence[int], first: int = 0
    ) -> None:
        if not block_ids:
            return
        runs = block_runs(block_ids)
        for view, region in view_regions(views, src):
            for pos, bid, length in runs:
                view[bid : bid + length].copy_(region[first + pos : first + pos + length], non_blocking=True)
