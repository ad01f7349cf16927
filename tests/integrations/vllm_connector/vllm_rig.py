"""The connector's test rig: both roles driven the way vLLM's scheduler and model runner drive
them, with vLLM's own config and KV-cache-config types and stand-ins for requests and scheduler
outputs. vLLM is imported inside the functions, so importing this module needs no vLLM.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch

L, NB, H, B, C = 2, 24, 2, 16, 8  # layers, blocks, kv heads, tokens per block, head size
CHUNK = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def kv_cache_config(num_blocks: int = NB) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=C, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def vllm_config(tmp_path, backend: str = "uni", role: str = "kv_both", policy: str = "fail", **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.integrations.vllm", kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"chunk_size": CHUNK, "host_capacity_gb": 0.001, "model_id": "tiny",
                                   "stats_file": str(tmp_path / "stats.jsonl"), **extra},
    )
    return SimpleNamespace(
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(model="tiny"),
        cache_config=SimpleNamespace(block_size=B, kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(distributed_executor_backend=backend, world_size=1),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


class Rig:
    """Both roles, vLLM's per-layer caches ([B, H, N, 2*head] per layer, LBHNC) and a step driver.

    In engine-core order: the worker registers its caches, the scheduler is built, then it gets
    the workers' handshake metadata (``handshake=False`` leaves that out).
    """

    def __init__(self, tmp_path, backend: str = "uni", role: str = "kv_both", seed: int = 0, handshake: bool = True,
                 num_blocks: int = NB, policy: str = "fail", **extra: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvdepot.integrations.vllm import KvDepotConnector

        config = vllm_config(tmp_path, backend, role, policy, **extra)
        self.stats_path = tmp_path / "stats.jsonl"
        self.worker = KvDepotConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
        buf = torch.zeros(L * num_blocks * H * B * 2 * C)
        self.caches = dict(zip(LAYERS, buf.view(L, num_blocks, H, B, 2 * C).unbind(0), strict=True))
        self.worker.register_kv_caches(self.caches)
        self.sched = KvDepotConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(num_blocks))
        if handshake:
            self.handshake()
        self.gen = torch.Generator().manual_seed(seed)

    def handshake(self) -> None:
        metadata = self.worker.get_handshake_metadata()
        if metadata is not None:  # vLLM collects it from every worker, keyed by TP rank
            self.sched.set_xfer_handshake_metadata({0: metadata})

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()

    def step(self, output: Any, computed_blocks: list[int] = ()) -> Any:
        """One engine step as vLLM's model runner runs it around a forward pass."""
        meta = self.sched.build_connector_meta(output)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for b in computed_blocks:  # the forward pass writes these blocks' KV
            for t in self.caches.values():
                t[b].copy_(torch.randn(t[b].shape, generator=self.gen))
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return meta

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = self.stats_path.read_text().splitlines() if self.stats_path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == name]


def request(rid: str, tokens: list[int], **kw: Any) -> Any:
    fields = dict(request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                  prompt_token_ids=list(tokens), mm_features=[], prompt_embeds=None, cache_salt=None, lora_request=None)
    fields.update(kw)
    return SimpleNamespace(**fields)


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def new_step(rid: str, block_ids: list[int], computed: int, scheduled: int, preempted: set[str] = frozenset()) -> Any:
    new = SimpleNamespace(req_id=rid, block_ids=(list(block_ids),), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: scheduled}, preempted_req_ids=set(preempted))


def cached_step(rid: str, new_block_ids: list[int], computed: int, scheduled: int, resumed: bool = False) -> Any:
    cached = SimpleNamespace(req_ids=[rid], resumed_req_ids={rid} if resumed else set(),
                             new_block_ids=[(list(new_block_ids),)], num_computed_tokens=[computed])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: scheduled}, preempted_req_ids=set())


def empty_step(preempted: set[str] = frozenset()) -> Any:
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
                           preempted_req_ids=set(preempted))


def engine():
    from kvdepot.integrations.vllm.providers import current_engine

    return current_engine()


TOKENS = list(range(1000, 1080))  # 80 tokens: 5 blocks, 2 full chunks


def serve_miss(rig: Rig, rid: str, tokens: list[int], block_ids: list[int]) -> None:
    """A request that misses, is prefilled in one step, and finishes."""
    req = request(rid, tokens)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    rig.sched.update_state_after_alloc(req, blocks(block_ids), 0)
    rig.step(new_step(rid, block_ids, 0, len(tokens)), computed_blocks=block_ids)
    assert rig.sched.request_finished(req, block_ids) == (True, None)  # saves ran: vLLM must wait for us
    assert rig.worker.get_finished({rid}) == ({rid}, None)
    assert rig.worker.get_finished(set()) == (None, None)  # reported once
