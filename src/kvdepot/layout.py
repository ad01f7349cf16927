"""The geometry of TensorRT-LLM's cross-layer KV pool, read from the pool tensor itself.

TensorRT-LLM hands the connector one contiguous tensor

    pool.shape == [num_blocks, num_layers, kv_factor, num_kv_heads * tokens_per_block * head_dim]

(kv_factor 2 for K and V, 1 for K-only caches such as MLA). ``pool[block_id]`` is one whole
block across every layer: the unit kvdepot moves. Heads and head_dim are not in the shape and
are not needed: blocks are moved as bytes, so any dtype (fp16, bf16, fp8, int8) works.
A chunk of ``chunk_size`` tokens is ``chunk_size // tokens_per_block`` consecutive positions
of a request's block list.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdepot.errors import LayoutError


@dataclass(frozen=True)
class PoolLayout:
    """Geometry of one KV pool plus the chunk arithmetic kvdepot needs over it."""

    num_blocks: int
    num_layers: int
    kv_factor: int
    block_elems: int  # num_kv_heads * tokens_per_block * head_dim
    dtype: torch.dtype
    tokens_per_block: int
    chunk_size: int
    # What decides the bytes' meaning when the pool is not TensorRT-LLM's (e.g. "vllm:CPU_ATTN:LBHNC"):
    # part of the geometry, so chunks of differently laid-out pools never share keys.
    tag: str = "trtllm"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_elems", "tokens_per_block", "chunk_size"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_factor not in (1, 2):
            raise LayoutError(f"kv_factor must be 1 (K only) or 2 (K and V), got {self.kv_factor}")
        if self.block_elems % self.tokens_per_block:
            raise LayoutError(
                f"block row of {self.block_elems} elements is not a multiple of tokens_per_block={self.tokens_per_block}"
            )
        if self.chunk_size % self.tokens_per_block:
            raise LayoutError(
                f"chunk_size={self.chunk_size} must be a multiple of the engine's tokens_per_block={self.tokens_per_block}"
            )

    @classmethod
    def from_pool(cls, pool: torch.Tensor, tokens_per_block: int, chunk_size: int) -> PoolLayout:
        """Read the geometry of a TensorRT-LLM pool tensor; reject anything else clearly."""
        if not isinstance(pool, torch.Tensor):
            raise LayoutError(f"KV pool must be a torch.Tensor, got {type(pool).__name__}")
        if pool.dim() != 4:
            raise LayoutError(
                "KV pool must be 4-D [num_blocks, num_layers, kv_factor, heads*tokens_per_block*head_dim], "
                f"got shape {tuple(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise LayoutError("KV pool must be contiguous (TensorRT-LLM's primary pool is)")
        if pool.dtype.is_complex or pool.dtype == torch.bool:
            raise LayoutError(f"KV pool dtype {pool.dtype} is not a KV cache dtype")
        nb, nl, kf, elems = pool.shape
        return cls(nb, nl, kf, elems, pool.dtype, tokens_per_block, chunk_size)

    @classmethod
    def from_views(
        cls,
        views: Sequence[torch.Tensor],
        dtype: torch.dtype,
        tokens_per_block: int,
        chunk_size: int,
        *,
        kv_factor: int = 2,
        tag: str,
    ) -> PoolLayout:
        """The geometry of a pool given as per-layer block views (``transfer.base``), one per layer."""
        if not views:
            raise LayoutError("no KV cache views to register")
        for v in views:
            if v.dtype != torch.uint8 or v.dim() != 2:
                raise LayoutError(f"block views must be 2-D uint8 [num_blocks, seg_bytes], got {v.dtype} {tuple(v.shape)}")
        num_blocks, seg = views[0].shape
        if any(tuple(v.shape) != (num_blocks, seg) for v in views):
            shapes = sorted({tuple(v.shape) for v in views})
            raise LayoutError(f"every layer's blocks must be the same size; got views of shapes {shapes}")
        es = torch.empty((), dtype=dtype).element_size()
        if seg % (es * kv_factor):
            raise LayoutError(f"a layer segment of {seg} B is not {kv_factor} x whole {dtype} elements")
        return cls(num_blocks, len(views), kv_factor, seg // es // kv_factor, dtype, tokens_per_block, chunk_size, tag)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize  # NOTE: not torch.empty((), dtype).element_size(): ~5 us a call

    # Cached (in the instance's dict, which a frozen dataclass still has): every store and load
    # reads these before its first copy, on a GPU host with cold caches (issue 19).
    @functools.cached_property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V: what the leader sizes tiers by."""
        return self.num_layers * self.kv_factor * self.block_elems * self.element_size

    @functools.cached_property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.tokens_per_block

    @property
    def chunk_bytes(self) -> int:
        return self.blocks_per_chunk * self.bytes_per_block

    @property
    def geometry(self) -> tuple[int | str, ...]:
        """What must match for two pools' chunks to be interchangeable (num_blocks may differ).

        TensorRT-LLM pools keep the untagged form, so their keys never changed when tags came in.
        """
        base = (self.num_layers, self.kv_factor, self.block_elems, self.element_size, self.tokens_per_block)
        return base if self.tag == "trtllm" else (self.tag, *base)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def check_pool(self, pool: torch.Tensor) -> None:
        """Refuse a tensor that is not the registered pool's shape and dtype."""
        expected = (self.num_blocks, self.num_layers, self.kv_factor, self.block_elems)
        if tuple(pool.shape) != expected or pool.dtype != self.dtype:
            raise LayoutError(
                f"pool shape/dtype {tuple(pool.shape)}/{pool.dtype} does not match the registered {expected}/{self.dtype}"
            )

    def check_block_ids(self, block_ids: Sequence[int], *, distinct: bool = False) -> None:
        """Every id must be a row of the pool (and, with ``distinct``, appear once: one request's
        blocks); a bad id is an error before the operation moves anything but its lead
        (``engine_loads.LoadPath._check_lead``)."""
        if not block_ids:
            return
        # NOTE: no numpy: on a GPU host an operation starts with caches that the last one's DMA
        # swept, where numpy's sort-and-compare of 256 ids cost 30-60 us (H200, issue 19) and
        # four passes of Python's builtins over the caller's fresh list a fraction of that
        # (``bench bookkeeping --sweep-mib``: 104 against 26 us cold, 6 against 11 hot).
        try:  # pack() checks in C that every id is an integer, as a copy's address needs
            struct.pack(f"{len(block_ids)}q", *block_ids)
        except struct.error:
            self._refuse(block_ids)
        if min(block_ids) < 0 or max(block_ids) >= self.num_blocks:
            self._refuse(block_ids)
        if distinct and len(set(block_ids)) != len(block_ids):
            raise LayoutError("block ids of one request must be distinct")

    def _refuse(self, block_ids: Sequence[int]) -> None:
        """The error naming the first id that is not a row of the pool."""
        for b in block_ids:
            try:
                ok = bool(struct.pack("q", b)) and 0 <= b < self.num_blocks
            except struct.error:  # not an integer, or beyond 64 bits
                ok = False
            if not ok:
                raise LayoutError(f"block id {b!r} out of range [0, {self.num_blocks})")

    def full_chunks(self, num_tokens: int, num_block_ids: int) -> int:
        """Chunks that are complete in both the tokens and the block list given."""
        return min(num_tokens // self.chunk_size, num_block_ids // self.blocks_per_chunk)

    def chunk_blocks(self, chunk_index: int) -> range:
        """Positions in a request's block list that chunk ``chunk_index`` covers."""
        start = chunk_index * self.blocks_per_chunk
        return range(start, start + self.blocks_per_chunk)
