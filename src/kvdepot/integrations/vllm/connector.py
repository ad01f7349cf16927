"""vLLM KV connector (``KVConnectorBase_V1``): one class, two roles, two modes.

    KVTransferConfig(kv_connector="KvDepotConnector",
                     kv_connector_module_path="kvdepot.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"chunk_size": 256, "stats_file": "/tmp/kvdepot.jsonl"})

vLLM builds the class twice, once per role; this class only routes vLLM's calls to the role's
half (the logic mirrors the TensorRT-LLM connector step for step):

Scheduler role (``scheduler.py``)                   Worker role (``worker.py``)
  get_num_new_matched_tokens -> keys once, a          register_kv_caches -> per-layer block views
    lookup under a lease (id = request id); async     start_load_kv -> retrieve (sync load); take
    where part of the hit is on disk/Redis              async loads (sent once promoted)
  update_state_after_alloc -> the load vLLM took      wait_for_save -> store every chunk computed
  build_connector_meta -> deltas, load, chunks          by now (later prefill chunks too)
    computed after this step                          handle_preemptions -> wait for their saves
  request_finished -> True while saves may run        get_finished -> each delayed request once;
                                                        each async load once answered

Mode: with ``server_url`` set (extra config, ``KVDEPOT_SERVER_URL``, config file), both halves
talk to ``kvdepot server``: the scheduler and the worker may live in different processes and
several vLLM instances share one cache. Without it, in-process mode: the scheduler reads the
engine the worker registered in its own process. Each half gets its engine from the provider
``setup.py`` builds for the mode (modes: ``providers.py``; settings: ``setup.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvdepot.integrations.vllm.metadata import KvDepotVllmMetadata
from kvdepot.integrations.vllm.scheduler import Scheduler
from kvdepot.integrations.vllm.setup import Setup, ensure_log_handler
from kvdepot.integrations.vllm.worker import Worker

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KvDepotConnector(KVConnectorBase_V1):
    """kvdepot behind vLLM's V1 connector API; one class, two roles."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ensure_log_handler()
        setup = Setup.from_vllm(vllm_config, kv_cache_config)
        self._sched = Scheduler(setup) if role == KVConnectorRole.SCHEDULER else None
        self._worker = Worker(setup) if role != KVConnectorRole.SCHEDULER else None

    # A cache is best effort: a save lost to preemption is only a future miss.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- worker role -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvDepotVllmMetadata):
            self._worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvDepotVllmMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole blocks (every layer) are loaded in start_load_kv; nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Whole blocks are saved after the forward pass in wait_for_save; nothing per layer."""

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvDepotVllmMetadata):
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # ---- scheduler role ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request), None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._sched is not None:
            self._sched.set_handshake(metadata)
