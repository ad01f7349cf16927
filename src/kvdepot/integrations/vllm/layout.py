"""vLLM's per-layer KV caches as kvdepot block views.

vLLM (0.32) allocates one flat backing buffer and hands the connector one tensor per layer,
logically ``[num_blocks, H, N, C]`` (heads, tokens per block, content bytes), laid out by
the resolved ``KVCacheLayout``: the CPU attention backend uses LBHNC, where layer ``l``'s
block ``b`` is one dense run of ``H*N*C`` bytes (per head: the block's K rows, then its V
rows). kvdepot never interprets those bytes: it only needs, per layer, the byte span of each
block. ``block_view`` reads that span from the tensor's strides, for any layout in which a
block's bytes are dense within a layer (LBHNC, LBNHC, BLHNC, …), and refuses the others.

``PoolLayout.from_views`` and the engines (``providers.py``) take them from there. The views go to the core's transfer contract (``kvdepot.transfer.base``): block ``b`` of the
pool is ``views[0][b] ‖ views[1][b] ‖ …`` with one view per layer, sorted by layer name, so a
chunk's bytes do not depend on allocation order. Keys, tiers and exactness are the core's:
only the geometry in the namespace differs from TensorRT-LLM's, because the bytes differ.

Nothing here imports vLLM: the connector passes tensors and plain values in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvdepot.errors import LayoutError


def _natural_key(name: str) -> list[Any]:
    """``model.layers.10`` after ``model.layers.9``: digits compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _dense_span(t: torch.Tensor) -> int | None:
    """Element count of ``t`` if its elements form one gap-free run of memory, else None."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return t.numel()


def block_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A ``[num_blocks, block_bytes]`` uint8 view of one layer cache, aliasing its memory.

    ``t``'s first dimension counts blocks: ``num_blocks`` manager blocks, or a multiple of it
    when vLLM split each manager block into kernel blocks (then ``ratio`` consecutive kernel
    blocks are one manager block). Each manager block must be one dense run of bytes.
    """
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise LayoutError(f"a vLLM layer KV cache must be a tensor of >= 2 dims, got {type(t).__name__} {getattr(t, 'shape', '')}")
    if num_blocks <= 0 or t.shape[0] % num_blocks:
        raise LayoutError(f"layer cache with {t.shape[0]} blocks does not split into {num_blocks} manager blocks")
    ratio = t.shape[0] // num_blocks
    span = _dense_span(t[:ratio])
    if span is None:
        raise LayoutError(
            f"a block of the layer cache (shape {tuple(t.shape)}, strides {t.stride()}) is not one dense run "
            "of memory; kvdepot needs block-contiguous vLLM KV layouts (e.g. LBHNC, LBNHC, BLHNC)"
        )
    es = t.element_size()
    block_bytes = span * es
    stride_bytes = t.stride(0) * ratio * es
    if num_blocks > 1 and stride_bytes < block_bytes:
        raise LayoutError(f"blocks of the layer cache overlap (stride {stride_bytes} B < block {block_bytes} B)")
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat.as_strided((num_blocks, block_bytes), (stride_bytes, 1), t.storage_offset() * es)


def views_from_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, layer_names: Sequence[str] | None = None
) -> tuple[list[str], list[torch.Tensor]]:
    """One block view per distinct layer cache, ordered by layer name.

    ``layer_names`` limits the views to one KV cache group; layers that share another layer's
    cache (vLLM's cross-layer KV sharing) alias the same memory and are moved once.
    """
    names = sorted(layer_names if layer_names is not None else kv_caches, key=_natural_key)
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    out_names: list[str] = []
    views: list[torch.Tensor] = []
    for name in names:
        if name not in kv_caches:
            raise LayoutError(f"layer {name!r} has no KV cache among {sorted(kv_caches)[:4]}…")
        view = block_view(kv_caches[name], num_blocks)
        ident = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
        if ident in seen:
            continue
        seen[ident] = name
        out_names.append(name)
        views.append(view)
    _check_disjoint(views, out_names)
    return out_names, views


def _check_disjoint(views: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Distinct views must not overlap: a load into one would corrupt another."""
    spans = []
    for view, name in zip(views, names, strict=True):
        n, seg = view.shape
        start = view.data_ptr()
        spans.append((start, start + (n - 1) * view.stride(0) + seg, name, view))
    spans.sort(key=lambda s: s[0])
    for (_a0, a1, an, av), (b0, _b1, bn, bv) in zip(spans, spans[1:], strict=False):
        if b0 < a1 and not _interleaved(av, bv):
            raise LayoutError(f"KV caches of layers {an!r} and {bn!r} overlap")


def _interleaved(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Block-outermost layouts (BLHNC) interleave layers: each block's span is still disjoint."""
    if a.stride(0) != b.stride(0) or a.shape != b.shape:
        return False
    offset = b.data_ptr() - a.data_ptr()
    return a.shape[1] <= offset and offset + b.shape[1] <= a.stride(0)
