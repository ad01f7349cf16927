"""Block moves with plain torch ops: works for CPU and CUDA pools and every dtype (bytes only).

CPU pools: ``index_select``/``index_copy_`` (one op per view). CUDA pools: one
``copy_(non_blocking=True)`` per run of consecutive block ids between the pool and a pinned
host buffer, on the caller's current stream. TensorRT-LLM blocks are multi-MiB and contiguous
across layers, so a copy per run is already near the DMA ceiling for large models; small
blocks are where a gather kernel (``transfer/triton_mover``) pays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdepot.transfer.base import block_runs, view_regions


class TorchBlockMover:
    """The reference mover: correct on every device, fast for large blocks on CUDA."""

    def gather(
        self, views: Sequence[torch.Tensor], block_ids: Sequence[int], dst: torch.Tensor, first: int = 0
    ) -> None:
        n = len(block_ids)
        if not n:
            return
        if views[0].is_cuda:
            runs = block_runs(block_ids)
            for view, region in view_regions(views, dst):
                for pos, bid, length in runs:
                    region[first + pos : first + pos + length].copy_(view[bid : bid + length], non_blocking=True)
            return
        index = torch.as_tensor(block_ids, dtype=torch.long)
        for view, region in view_regions(views, dst):
            torch.index_select(view, 0, index, out=region[first : first + n])

    def scatter(
        self, src: torch.Tensor, views: Sequence[torch.Tensor], block_ids: Sequence[int], first: int = 0
    ) -> None:
        n = len(block_ids)
        if not n:
            return
        if views[0].is_cuda:
            runs = block_runs(block_ids)
            for view, region in view_regions(views, src):
                for pos, bid, length in runs:
                    view[bid : bid + length].copy_(region[first + pos : first + pos + length], non_blocking=True)
            return
        index = torch.as_tensor(block_ids, dtype=torch.long)
        for view, region in view_regions(views, src):
            view.index_copy_(0, index, region[first : first + n])
