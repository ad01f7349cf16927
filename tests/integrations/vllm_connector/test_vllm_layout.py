"""vLLM's per-layer KV caches as block views: geometry read from strides, exact byte moves.

The caches are built here the way vLLM 0.32 builds them (one flat buffer, a 5-D
``[L, B, H, N, C]`` strided view in the resolved layout's physical order, one ``[B, H, N, C]``
tensor per layer), so these tests need no vLLM.
"""

from __future__ import annotations

import pytest
import torch

from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.engine_api import Lease
from kvdepot.errors import LayoutError
from kvdepot.integrations.vllm.layout import (
    block_view,
    views_from_kv_caches,
)
from kvdepot.layout import PoolLayout

L, NB, H, N, C = 3, 12, 2, 4, 16  # layers, blocks, kv heads, tokens per block, content elements
ORDERS = {  # vLLM's KVCacheLayout stride orders over logical [L, B, H, N, C]
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),  # heads outside blocks: a block is not one run of memory
}


def make_caches(order: str, dtype: torch.dtype = torch.float32, num_blocks: int = NB) -> dict[str, torch.Tensor]:
    shape = (L, num_blocks, H, N, C)
    strides = [0] * 5
    step = 1
    for dim in reversed(ORDERS[order]):
        strides[dim] = step
        step *= shape[dim]
    buf = torch.zeros(step, dtype=dtype)
    view5 = buf.as_strided(shape, strides)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    return dict(zip(names, (view5[i] for i in range(L)), strict=True))


def fill(caches: dict[str, torch.Tensor], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen))


def engine_for(caches: dict[str, torch.Tensor], tag: str = "vllm:TEST:LBHNC", chunk: int = 8) -> CacheEngine:
    config = load_config(chunk_size=chunk, host_capacity_gb=0.01, model_id="tiny")
    _, views = views_from_kv_caches(caches, NB)
    layout = PoolLayout.from_views(views, torch.float32, N, chunk, tag=tag)
    return CacheEngine.for_views(views, layout, config)


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_block_views_alias_each_layers_block_bytes(order: str) -> None:
    caches = make_caches(order)
    fill(caches)
    names, views = views_from_kv_caches(caches, NB)
    assert names == sorted(caches) and len(views) == L
    for t, v in zip(caches.values(), views, strict=True):
        assert v.dtype == torch.uint8 and tuple(v.shape) == (NB, H * N * C * 4)
        for b in (0, 5, NB - 1):
            # The block's bytes, whatever their order inside it, are exactly the view's row.
            assert sorted(v[b].tolist()) == sorted(t[b].contiguous().view(torch.uint8).flatten().tolist())
        v[3].fill_(0)  # a view aliases the cache: writes land in vLLM's tensor
        assert not t[3].any() and t[4].any()


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC"])
def test_store_then_retrieve_into_other_blocks_is_bit_exact(order: str) -> None:
    caches = make_caches(order)
    fill(caches, seed=1)
    engine = engine_for(caches)
    keys = engine.chunk_keys(list(range(100, 116)))  # two chunks of 8 tokens = 4 blocks of 4
    src, dst = [1, 2, 7, 8], [9, 3, 10, 4]
    assert engine.store(keys, src).chunks == 2
    assert engine.lookup(keys, lease=Lease("r")) == 16
    assert engine.retrieve(keys, dst, lease=Lease("r")) == 16
    for t in caches.values():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(t[d], t[s])  # every layer, K and V, bit for bit
    untouched = [b for b in range(NB) if b not in dst]
    before = {name: t[untouched].clone() for name, t in caches.items()}
    engine.retrieve(keys, dst, skip_blocks=1)  # blocks the engine holds are never rewritten
    for name, t in caches.items():
        assert torch.equal(t[untouched], before[name])
    stats = engine.stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0


def test_layout_with_heads_outside_blocks_is_refused() -> None:
    with pytest.raises(LayoutError, match="dense run"):
        views_from_kv_caches(make_caches("LHBNC"), NB)


def test_kernel_blocks_group_into_manager_blocks() -> None:
    caches = make_caches("LBHNC", num_blocks=2 * NB)  # vLLM split each manager block in two
    _, views = views_from_kv_caches(caches, NB)
    t = next(iter(caches.values()))
    assert tuple(views[0].shape) == (NB, 2 * H * N * C * 4)
    views[0][5].fill_(1)
    assert t[10].view(torch.uint8).eq(1).all() and t[11].view(torch.uint8).eq(1).all() and not t[12].any()
    with pytest.raises(LayoutError, match="manager blocks"):
        block_view(t, NB + 1)


def test_shared_layers_are_moved_once_and_order_is_by_layer_number() -> None:
    caches = make_caches("LBHNC")
    names = sorted(caches)
    caches = {f"model.layers.{i}.self_attn.attn": caches[names[i % L]] for i in range(12)}  # layer 10 after 9
    got, views = views_from_kv_caches(caches, NB)
    assert got == [f"model.layers.{i}.self_attn.attn" for i in range(L)] and len(views) == L


def test_geometry_keeps_vllm_chunks_apart_from_trtllm_and_other_layouts() -> None:
    caches = make_caches("LBHNC")
    a = engine_for(caches, tag="vllm:CPU_ATTN:LBHNC")
    b = engine_for(caches, tag="vllm:CPU_ATTN:LBNHC")
    pool = torch.zeros(NB, L, 2, H * N * C // 2)  # a TensorRT-LLM pool of the same bytes per block
    trt = CacheEngine.for_pool(pool, N, load_config(chunk_size=8, host_capacity_gb=0.01, model_id="tiny"))
    assert a.layout.bytes_per_block == trt.layout.bytes_per_block
    tokens = list(range(16))
    keys = {e.chunk_keys(tokens)[0] for e in (a, b, trt)}
    assert len(keys) == 3


def test_reregistering_views_of_another_geometry_is_refused() -> None:
    caches = make_caches("LBHNC")
    engine = engine_for(caches)
    _, views = views_from_kv_caches(caches, NB)
    engine.register_views(views, PoolLayout.from_views(views, torch.float32, N, 8, tag="vllm:TEST:LBHNC"))
    with pytest.raises(LayoutError, match="geometry"):
        engine.register_views(views, PoolLayout.from_views(views, torch.float32, N, 8, tag="other"))
    with pytest.raises(LayoutError, match="geometry"):  # a TensorRT-LLM pool is another geometry
        engine.register_pool(torch.zeros(NB, L, 2, 8))
