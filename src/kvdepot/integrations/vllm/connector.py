"""vLLM KV connector (``KVConnectorBase_V1``), in-process mode: one kvdepot engine per process.

    KVTransferConfig(kv_connector="KvDepotConnector",
                     kv_connector_module_path="kvdepot.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"chunk_size": 256, "stats_file": "/tmp/kvdepot.jsonl"})

vLLM builds the class twice, once per role; the logic mirrors the TensorRT-LLM adapter
(``integrations/tensorrt_llm/adapter.py``) step for step:

Scheduler role                                     Worker role
  get_num_new_matched_tokens -> keys once,           register_kv_caches -> per-layer block views
    engine.lookup under a lease (id = request id)      -> the process's engine
  update_state_after_alloc -> block ids, the load    start_load_kv -> engine.retrieve (sync load)
    vLLM accepted                                     wait_for_save -> engine.store of every chunk
  build_connector_meta -> deltas (keys, blocks),       computed by now (later prefill chunks too)
    load, chunks computed after this step            handle_preemptions -> wait for their saves
  request_finished -> True while saves may run       get_finished -> each delayed request once,
                                                       after waiting for its saves

In-process means the scheduler's lookups read the engine the worker registered, so the vLLM
worker must run in the scheduler's process: vLLM's ``uni`` executor with one worker (the
default on GPU with TP=1; on CPU set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, since vLLM's CPU
platform otherwise forces the ``mp`` executor). Anywhere else the connector says so once and
stays out of the way (no hits, no saves): it never guesses at a cache it cannot see.

Extra config keys: any kvdepot config key (``chunk_size``, ``host_capacity_gb``, …, or
LMCache's names for them) over the usual sources, and ``stats_file``: a JSON-lines file that
lookups, loads, stores and engine stats are appended to, readable from outside vLLM's
processes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvdepot.config import load_config
from kvdepot.engine import CacheEngine, StoreHandle
from kvdepot.integrations.vllm.layout import (
    current_engine,
    get_or_create_engine,
    views_from_kv_caches,
)
from kvdepot.integrations.vllm.metadata import KvDepotVllmMetadata, VllmRequestMeta
from kvdepot.keys import ChunkHasher
from kvdepot.layout import PoolLayout

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

logger = logging.getLogger("kvdepot")

OWN_EXTRA_KEYS = frozenset({"stats_file"})
IN_PROCESS_BACKENDS = ("uni", "external_launcher")


def _ensure_log_handler() -> None:
    """vLLM configures only its own logger: give ours a handler when nobody else did."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("kvdepot %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


class _StatsFile:
    """Appends one JSON object per line; each write is one small ``O_APPEND`` write."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "pid": os.getpid(), "t": round(time.time(), 6), **fields}) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)


def _depot_config(vllm_config: VllmConfig, extra: dict[str, Any]):
    overrides = {k: v for k, v in extra.items() if k not in OWN_EXTRA_KEYS}
    config = load_config(**overrides)
    if not config.model_id:
        model = getattr(getattr(vllm_config, "model_config", None), "model", "") or ""
        config = load_config(**overrides, model_id=str(model))
    logger.setLevel(config.log_level)
    return config


def _group_spec(kv_cache_config: KVCacheConfig | None) -> tuple[Any, list[str]] | None:
    """The single full-attention KV cache group's spec and layers, or None if unsupported."""
    if kv_cache_config is None:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    spec = groups[0].kv_cache_spec
    # NOTE: exact types: subclasses (sinks, hidden states, …) change what a block holds.
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return None
    return spec, list(groups[0].layer_names)


class KvDepotConnector(KVConnectorBase_V1):
    """kvdepot behind vLLM's V1 connector API; one class, two roles."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _ensure_log_handler()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._config = _depot_config(vllm_config, extra)
        self._stats = _StatsFile(extra.get("stats_file"))
        group = _group_spec(kv_cache_config)
        self._block = int(group[0].block_size) if group else int(vllm_config.cache_config.block_size)
        self._supported = group is not None
        if not self._supported:
            logger.warning("kvdepot: only models with one full-attention KV cache group are supported; kvdepot is off")
        self._sched: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self, vllm_config)
        else:
            self._worker = _Worker(self, vllm_config, group)

    # A cache is best effort: a save lost to preemption is only a future miss.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- worker role -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

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
        return self._worker.finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler role ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request), None


@dataclass
class _SchedRequest:
    """What the scheduler role knows of one live request."""

    request: Any  # vLLM's Request: its token list grows in place during decode
    hasher: ChunkHasher
    keys: list[bytes]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    sent_keys: int = 0
    sent_blocks: int = 0
    skip_blocks: int = 0  # where a load would start (blocks vLLM holds already)
    load: tuple[int, int] | None = None  # (skip_blocks, num_blocks) not yet sent to the worker
    saved_upto: int = 0  # chunks the worker was told to save
    known: bool = False  # the worker holds state for it
    reset: bool = True  # the next item tells the worker to start this request over


class _Scheduler:
    def __init__(self, owner: KvDepotConnector, vllm_config: VllmConfig) -> None:
        self._owner = owner
        self._block = owner._block
        self._requests: dict[str, _SchedRequest] = {}
        self._hashers: dict[tuple[str, str], ChunkHasher] = {}
        self._warned_async = False
        transfer = owner._kv_transfer_config
        self._loads = bool(transfer.is_kv_consumer)  # kv_role: kv_both / kv_consumer load, ...
        self._saves = bool(transfer.is_kv_producer)  # ... kv_both / kv_producer save
        parallel = vllm_config.parallel_config
        self._disabled_reason = ""
        backend = getattr(parallel, "distributed_executor_backend", None)
        if not owner._supported:
            self._disabled_reason = "unsupported KV cache groups"
        elif int(getattr(parallel, "world_size", 1) or 1) > 1:
            self._disabled_reason = f"world_size={parallel.world_size}: in-process mode sees one worker's cache only"
        elif backend not in IN_PROCESS_BACKENDS:
            self._disabled_reason = (
                f"distributed_executor_backend={backend!r} runs the worker in another process; in-process mode needs "
                "'uni' (on CPU: set VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        if self._disabled_reason:
            logger.warning("kvdepot: %s; kvdepot is off (no lookups, no saves)", self._disabled_reason)

    def _engine(self) -> CacheEngine | None:
        return None if self._disabled_reason else current_engine()

    def _hasher(self, engine: CacheEngine, request: Any) -> ChunkHasher:
        """Keys of a request with a cache salt or a LoRA adapter live in their own namespace."""
        salt = getattr(request, "cache_salt", None) or ""
        lora = getattr(request, "lora_request", None)
        lora_id = f"{getattr(lora, 'lora_name', '')}#{getattr(lora, 'lora_int_id', '')}" if lora is not None else ""
        if not salt and not lora_id:
            return engine.hasher
        hasher = self._hashers.get((salt, lora_id))
        if hasher is None or hasher.namespace.geometry != engine.namespace.geometry:
            ns = replace(engine.namespace, cache_salt=f"{engine.namespace.cache_salt}\0salt={salt}\0lora={lora_id}")
            hasher = self._hashers[(salt, lora_id)] = ChunkHasher(ns, engine.config.hash_algo)
        return hasher

    @staticmethod
    def _cacheable(request: Any) -> bool:
        """Token ids must decide the KV: no multimodal inputs, no prompt embeddings."""
        return (
            getattr(request, "prompt_token_ids", None) is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
        )

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        rid = request.request_id
        engine = self._engine()
        old = self._requests.pop(rid, None)
        if old is not None and engine is not None:
            engine.release(rid)  # vLLM asks again when it could not schedule the request
        if engine is None or not self._cacheable(request) or num_computed_tokens % self._block:
            return 0
        tokens = list(request.all_token_ids)
        hasher = self._hasher(engine, request)
        state = _SchedRequest(request, hasher, hasher.chunk_keys(tokens), int(request.num_prompt_tokens))
        state.skip_blocks = num_computed_tokens // self._block
        self._requests[rid] = state
        hit = engine.probe(keys=state.keys, skip_tokens=num_computed_tokens, lease=rid)
        # Host memory serves this request; chunks found only on disk/Redis are promoted in the
        # background for later requests (lower_tier_hits: prefetch, always exact).
        if engine.config.lower_tier_hits != "prefetch" and not self._warned_async:
            logger.warning("kvdepot: vLLM adapter serves disk/Redis hits as 'prefetch' (async loads: not yet)")
            self._warned_async = True
        # Leave at least one token to compute: vLLM needs one to produce the next token.
        limit = (len(tokens) - 1) // self._block * self._block
        usable = hit.host_tokens if self._loads else 0
        matched = max(0, min(usable, limit) - num_computed_tokens) // self._block * self._block
        if matched:
            state.load = (state.skip_blocks, matched // self._block)
        else:
            engine.release(rid)  # a promotion it started runs on as a prefetch
        logger.info("lookup req=%s vllm_matched=%d cached=%d new_matched=%d", rid, num_computed_tokens, hit.tokens, matched)
        self._owner._stats.write(
            "lookup", req=rid, tokens=len(tokens), vllm_matched=num_computed_tokens, cached=hit.tokens,
            host=hit.host_tokens, new_matched=matched,
        )
        return matched

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        # Load exactly what vLLM accepted: it may take less than offered (or nothing).
        if num_external_tokens <= 0:
            if state.load is not None:
                engine = self._engine()
                if engine is not None:
                    engine.release(request.request_id)
            state.load = None
        elif state.load is not None:
            state.load = (state.load[0], num_external_tokens // self._block)

    def build_meta(self, scheduler_output: Any) -> KvDepotVllmMetadata:
        meta = KvDepotVllmMetadata(preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        for rid in meta.preempted:
            # vLLM freed its blocks and the worker drops its state: whatever it saved is
            # cached already, and request_finished must not hold blocks it no longer has.
            state = self._requests.get(rid)
            if state is not None:
                state.known, state.saved_upto, state.reset = False, 0, True
                state.sent_keys = state.sent_blocks = 0
        engine = self._engine()
        if engine is None:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for data in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(data.req_id)
            if state is None:
                continue
            state.block_ids = list(data.block_ids[0]) if data.block_ids else []
            self._plan(engine, data.req_id, state, data.num_computed_tokens + scheduled.get(data.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # a preempted request comes back with a new block list
                state.block_ids = list(new_ids[0]) if new_ids else []
                state.sent_blocks, state.reset = 0, True
                state.sent_keys = 0
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(engine, rid, state, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        return meta

    def _plan(self, engine: CacheEngine, rid: str, state: _SchedRequest, computed: int, meta: KvDepotVllmMetadata) -> None:
        """Emit this step's load and the chunks that will be fully computed after this step."""
        num_tokens = state.request.num_tokens
        limit = computed if engine.config.save_decode_cache else min(computed, state.prompt_len)
        limit = min(limit, num_tokens, len(state.block_ids) * self._block)
        upto = limit // engine.layout.chunk_size if self._saves else 0
        if upto > len(state.keys):
            state.keys = state.hasher.extend(state.keys, list(state.request.all_token_ids))
            upto = min(upto, len(state.keys))
        load = state.load
        if load is None and upto <= state.saved_upto and not state.reset:
            return
        item = VllmRequestMeta(
            rid,
            new_keys=state.keys[state.sent_keys :],
            new_block_ids=state.block_ids[state.sent_blocks :],
            load_skip_blocks=load[0] if load else 0,
            load_num_blocks=load[1] if load else 0,
            save_upto_chunks=max(upto, state.saved_upto),
            reset=state.reset,
        )
        state.sent_keys, state.sent_blocks = len(state.keys), len(state.block_ids)
        state.load, state.saved_upto, state.known, state.reset = None, item.save_upto_chunks, True, False
        meta.requests.append(item)

    def finished(self, request: Any) -> bool:
        """True while the request's saves may still be copying: vLLM keeps its blocks until get_finished."""
        rid = request.request_id
        state = self._requests.pop(rid, None)
        engine = self._engine()
        if engine is not None:
            engine.release(rid)
        return bool(state is not None and state.known and state.saved_upto)


@dataclass
class _WorkerRequest:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks already handed to engine.store
    delayed: bool = False  # the scheduler told us to save: it returns True from request_finished
    handles: list[StoreHandle] = field(default_factory=list)


class _Worker:
    def __init__(self, owner: KvDepotConnector, vllm_config: VllmConfig, group: tuple[Any, list[str]] | None) -> None:
        self._owner = owner
        self._vllm_config = vllm_config
        self._group = group
        self._engine: CacheEngine | None = None
        self._requests: dict[str, _WorkerRequest] = {}
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()

    def register(self, kv_caches: dict[str, Any]) -> None:
        if self._group is None:
            return
        spec, layer_names = self._group
        kv_cache_config = self._owner._kv_cache_config
        names, views = views_from_kv_caches(kv_caches, int(kv_cache_config.num_blocks), layer_names)
        config = self._owner._config
        cache_config = self._vllm_config.cache_config
        kv_layout = getattr(cache_config, "kv_cache_layout", None) or "default"
        backend = self._backend_name(names[0])
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        kv_factor = 1 if isinstance(spec, MLAAttentionSpec) else 2
        layout = PoolLayout.from_views(
            views, spec.dtype, int(spec.block_size), config.chunk_size, kv_factor=kv_factor,
            tag=f"vllm:{backend}:{kv_layout}",
        )
        rank, size = self._tp()
        self._engine = get_or_create_engine(views, layout, config, tp_rank=rank, tp_size=size)
        self._requests.clear()
        logger.info(
            "kvdepot: engine ready (%d layer views of %d blocks x %d B, %s, chunk %d tokens, host %d chunks)",
            len(views), layout.num_blocks, views[0].shape[1], layout.tag, layout.chunk_size, self._engine.host.num_slots,
        )
        self._owner._stats.write("register", layers=len(views), num_blocks=layout.num_blocks, tag=layout.tag,
                                 bytes_per_block=layout.bytes_per_block, chunk_size=layout.chunk_size)

    def _backend_name(self, layer_name: str) -> str:
        ctx = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
        backend = getattr(ctx.get(layer_name), "attn_backend", None)
        try:
            return str(backend.get_name()) if backend is not None else "unknown"
        except Exception:  # pragma: no cover - a backend without a name
            return "unknown"

    @staticmethod
    def _tp() -> tuple[int, int]:
        try:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
        except Exception:  # noqa: BLE001 - no TP group (tests, single process)
            return 0, 1

    # ---- per step ------------------------------------------------------------------------
    def preempted(self, meta: KvDepotVllmMetadata) -> None:
        """vLLM frees a preempted request's blocks: its saves must be done reading them first."""
        for rid in meta.preempted:
            state = self._requests.pop(rid, None)
            if state is not None:
                for handle in state.handles:
                    handle.wait()
            self._finishing.discard(rid)

    def start_load(self, meta: KvDepotVllmMetadata) -> None:
        if self._engine is None:
            return
        for item in meta.requests:
            state = self._requests.get(item.request_id)
            if item.reset or state is None:
                if state is not None:
                    for handle in state.handles:
                        handle.wait()
                state = self._requests[item.request_id] = _WorkerRequest()
            state.keys.extend(item.new_keys)
            state.block_ids.extend(item.new_block_ids)
            if item.save_upto_chunks:
                state.delayed = True
            if item.load_num_blocks:
                self._load(item, state)

    def _load(self, item: VllmRequestMeta, state: _WorkerRequest) -> None:
        assert self._engine is not None
        engine = self._engine
        B, bpc = engine.layout.tokens_per_block, engine.layout.blocks_per_chunk
        skip, num = item.load_skip_blocks, item.load_num_blocks
        end = skip + num
        # Keys only as far as the load reaches: vLLM allocates blocks for this step's tokens,
        # not for the whole prompt, and the engine checks keys against the block list.
        chunks = min(-(-end // bpc), len(state.keys), len(state.block_ids) // bpc)
        got_tokens = skip * B
        if chunks * bpc > skip:
            got_tokens = engine.retrieve(
                None, state.block_ids[: chunks * bpc], keys=state.keys[:chunks], skip_blocks=skip,
                num_blocks=min(num, chunks * bpc - skip), lease=item.request_id,
            )
        else:
            engine.release(item.request_id)
        got = got_tokens // B
        state.saved = max(state.saved, min(got // bpc, len(state.keys)))  # loaded chunks are cached already
        if got < end:  # a lease expired before the load: never silent, vLLM recomputes or fails
            missing = state.block_ids[got:end]
            self._load_errors.update(missing)
            logger.error("kvdepot: req=%s loaded %d of %d blocks; reporting %d as load errors",
                         item.request_id, got - skip, num, len(missing))
        self._owner._stats.write("load", req=item.request_id, skip_blocks=skip, blocks=max(0, got - skip), wanted=num)

    def save(self, meta: KvDepotVllmMetadata) -> None:
        """Copy this step's newly computed chunks out; on CUDA, enqueued behind the forward pass."""
        if self._engine is None:
            return
        bpc = self._engine.layout.blocks_per_chunk
        for item in meta.requests:
            state = self._requests.get(item.request_id)
            if state is None or item.save_upto_chunks <= state.saved:
                continue
            first, upto = state.saved, min(item.save_upto_chunks, len(state.keys), len(state.block_ids) // bpc)
            if upto <= first:
                continue
            handle = self._engine.store(None, state.block_ids[first * bpc : upto * bpc], keys=state.keys[first:upto])
            state.saved = upto
            state.handles.append(handle)
            self._owner._stats.write("store", req=item.request_id, first_chunk=first, upto_chunk=upto, new_chunks=handle.chunks)

    def finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """Each request whose request_finished returned True, once, when its stores completed."""
        for rid in finished_req_ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            if state.delayed:
                # Its last save was enqueued a step or more ago: waiting here is short, and
                # reporting now frees the blocks even if vLLM goes idle after this step.
                for handle in state.handles:
                    handle.wait()
                self._finishing.add(rid)
            else:
                del self._requests[rid]
        done = set()
        for rid in list(self._finishing):
            state = self._requests.get(rid)
            if state is None or all(h.done() for h in state.handles):
                done.add(rid)
                self._finishing.discard(rid)
                self._requests.pop(rid, None)
        if done and self._engine is not None:
            self._owner._stats.write("finished", req=sorted(done), stats=asdict(self._engine.stats()))
        return done or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """vLLM is closing this worker: finish copies and drain write-behind to disk/Redis."""
        if self._engine is not None:
            self._engine.close()
            self._owner._stats.write("shutdown", stats=asdict(self._engine.stats()))
