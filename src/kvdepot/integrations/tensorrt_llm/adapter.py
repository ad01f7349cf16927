"""TensorRT-LLM KV connector, in-process mode: kvdepot's engine lives in the TensorRT-LLM process.

    KvCacheConnectorConfig(connector_module="kvdepot.integrations.tensorrt_llm.adapter",
                           connector_scheduler_class="KvDepotConnectorScheduler",
                           connector_worker_class="KvDepotConnectorWorker")

Scheduler (rank 0)                               Worker (every rank)
  get_num_new_matched_tokens -> engine.lookup      register_kv_caches -> engine singleton
  build_connector_meta -> KvDepotMetadata          start_load_kv -> engine.retrieve (load stream)
  request_finished -> True while saves run         wait_for_save -> notes the step's saves
                                                   get_finished -> engine.store (store stream, after
                                                     sampling); requests whose saves completed
Loads by layer (``load_by_layer: auto``, CUDA pools whose per-layer parts are >= 64 KiB): the
load is copied layer by layer and ``wait_for_layer_load(i)`` makes the forward stream wait only
for layer ``i``, so a hit's copies overlap the forward over the new tokens; the copies are
enqueued a few layers ahead of the hooks (``transfer/layered.py``), and in MP mode by the server
before it answers (``mp_adapter``). The worker only does
so once it has seen a whole forward's layer hooks fire (TensorRT-LLM skips them on CUDA-graph
replays); a layered load whose layers were not all waited for is waited for wholly at
``wait_for_save``, logged, and layered loads are turned off. Otherwise the hit loads whole in
``start_load_kv`` and the forward stream waits for all of it. Saves are always whole blocks.

A hit in host memory loads synchronously in ``start_load_kv``. Chunks found only on disk or in
Redis are promoted into host memory in the background; the scheduler never waits for them.
With ``lower_tier_hits: prefetch`` (default) this request counts only the host part and later
requests hit the promoted chunks: a load can never be promised bytes that then fail to arrive.
With ``lower_tier_hits: async`` the request is promised the whole hit with ``is_async=True``:
TensorRT-LLM parks it, and the worker loads and reports it through ``get_finished`` once the
promotion is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvdepot.engine import CacheEngine, StoreHandle
from kvdepot.integrations.planner import DeltaPlanner, SentState
from kvdepot.integrations.saves import take_saved
from kvdepot.integrations.tensorrt_llm.api import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)
from kvdepot.integrations.tensorrt_llm.metadata import KvDepotMetadata, RequestMeta
from kvdepot.integrations.tensorrt_llm.utils import (
    current_engine,
    get_or_create_engine,
    tokens_per_block,
)
from kvdepot.transfer.layered import LayerWaits, TransferFailed

logger = logging.getLogger("kvdepot")


@dataclass(kw_only=True)
class _SchedRequest(SentState):
    """What the scheduler knows of one live request: the planner's sent-state plus its tokens."""

    tokens: list[int]
    load_async: bool = False  # the load waits for a promotion from a lower tier


class KvDepotConnectorScheduler(KvCacheConnectorScheduler):
    """Decides, per request, which blocks kvdepot loads and which chunks it saves."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._block = tokens_per_block(llm_args)
        self._tp_size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
        self._engine: CacheEngine | None = None
        self._requests: dict[int, _SchedRequest] = {}
        self._planner = DeltaPlanner(self._block)
        self._finished: list[int] = []
        self._warned_tp = False

    def _resolve(self) -> CacheEngine | None:
        if self._engine is None:
            self._engine = current_engine()
        return self._engine

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = int(request.request_id)
        engine = self._resolve()
        tokens = list(request.get_tokens(0))
        if engine is None or self._refuse_tp() or num_computed_tokens % self._block:
            logger.info("lookup req=%s trt_matched=%d cached=0 new_matched=0", rid, num_computed_tokens)
            return 0, False
        if rid in self._requests:
            logger.warning("kvdepot: request id %s seen again before it finished; its old state is dropped", rid)
            engine.release(rid)
        state = _SchedRequest(getattr(request, "prompt_len", len(tokens)), engine.chunk_keys(tokens), tokens=tokens)
        self._requests[rid] = state
        hit = engine.probe(keys=state.keys, skip_tokens=num_computed_tokens, lease=rid)
        usable = hit.tokens if engine.config.lower_tier_hits == "async" else hit.host_tokens
        # Leave at least one prompt token to compute (TensorRT-LLM checks prepopulated < prompt_len).
        limit = (state.prompt_len - 1) // self._block * self._block
        matched = max(0, min(usable, limit) - num_computed_tokens) // self._block * self._block
        if matched:
            state.load = (num_computed_tokens // self._block, matched // self._block)
            state.load_async = num_computed_tokens + matched > hit.host_tokens
        else:
            engine.release(rid)
        logger.info(
            "lookup req=%s trt_matched=%d cached=%d new_matched=%d%s", rid, num_computed_tokens, hit.tokens,
            matched, " async" if state.load_async else "",
        )
        return matched, state.load_async

    def _refuse_tp(self) -> bool:
        """In-process mode cannot see other ranks' caches, so under TP it never claims a hit."""
        if self._tp_size > 1 and not self._warned_tp:
            logger.warning("kvdepot: tensor_parallel_size>1 needs the multi-process adapter; in-process hits are off")
            self._warned_tp = True
        return self._tp_size > 1

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        state = self._requests.get(int(request.request_id))
        if state is not None:
            state.block_ids = list(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvDepotMetadata:
        meta = KvDepotMetadata(finished=self._finished)
        self._finished = []
        engine = self._resolve()
        if engine is None:
            return meta
        for data in scheduler_output.new_requests:
            state = self._requests.get(data.request_id)
            if state is None:  # never looked up (engine was not ready then): saves only
                tokens = list(data.new_tokens)
                state = _SchedRequest(len(tokens), engine.chunk_keys(tokens), tokens=tokens)
                self._requests[data.request_id] = state
            if len(data.new_block_ids) > len(state.block_ids):
                state.block_ids = list(data.new_block_ids)
            loading = state.load[1] * self._block if state.load else 0
            self._plan(engine, data.request_id, state, data.computed_position + loading + data.num_scheduled_tokens, meta)
        for data in scheduler_output.cached_requests:
            state = self._requests.get(data.request_id)
            if state is None:
                continue
            state.tokens.extend(data.new_tokens)
            state.block_ids.extend(data.new_block_ids)
            self._plan(engine, data.request_id, state, data.computed_position + data.num_scheduled_tokens, meta)
        for rid, state in self._requests.items():  # parked for an async load: not in the output
            if state.load is not None and state.load_async and state.block_ids:
                self._plan(engine, rid, state, 0, meta)
        return meta

    def _plan(self, engine: CacheEngine, rid: int, state: _SchedRequest, computed: int, meta: KvDepotMetadata) -> None:
        """The shared planner's delta for this step, as TensorRT-LLM's item (plus the async-load flag)."""
        planned = self._planner.plan(
            rid, state, computed, len(state.tokens), chunk_size=engine.layout.chunk_size,
            save_decode=engine.config.save_decode_cache, more_keys=lambda: engine.hasher.extend(state.keys, state.tokens),
        )
        # NOTE: a lookup here never promises 0 blocks, so a load in the delta is the one it promised.
        if planned is not None:
            delta = planned.delta
            meta.requests.append(RequestMeta(**vars(delta), load_async=state.load_async and delta.load_num_blocks > 0))

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True while the request's saves may still be copying: keep its blocks until get_finished."""
        rid = int(request.request_id)
        state = self._requests.pop(rid, None)
        engine = self._resolve()
        if engine is not None:
            engine.release(rid)
        if state is None or not state.known:
            return False
        if state.saved_upto:
            return True
        self._finished.append(rid)
        return False


@dataclass
class _WorkerRequest:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks already handed to engine.store
    handles: list[StoreHandle] = field(default_factory=list)


class KvDepotConnectorWorker(KvCacheConnectorWorker):
    """Moves whole blocks between TensorRT-LLM's pool and kvdepot, off the forward stream."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._engine: CacheEngine | None = None
        self._requests: dict[int, _WorkerRequest] = {}
        self._finishing: set[int] = set()
        self._async_loads: dict[int, RequestMeta] = {}  # waiting for their promotion
        self._loaded: set[int] = set()  # async loads done, not reported yet
        self._started: set[int] = set()  # async loads TensorRT-LLM has seen start (get_finished's argument)
        self._pending_saves: list[tuple[_WorkerRequest, list[int], list[bytes]]] = []  # noted, not enqueued
        self._save_stream: Any = None
        self._layered: list[LayerWaits] = []  # this forward's layered loads
        self._hook_layers = 0  # layers 0.. whose wait_for_layer_load this forward has called, in order
        self._hooks_fire = False  # a whole forward's hooks were seen: layered loads will be waited for
        self._hooks_failed = False  # a forward skipped a layered load's layer: whole loads for good

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self._engine = get_or_create_engine(self._llm_args, kv_cache_tensor)
        self._requests.clear()

    def _meta(self) -> KvDepotMetadata | None:
        meta = self._metadata
        return meta if isinstance(meta, KvDepotMetadata) and self._engine is not None else None

    def start_load_kv(self, stream: Any) -> None:
        meta = self._meta()
        if meta is None:
            return
        self._submit_saves()
        self._settle_layered(stream)  # a forward that never came (never in TensorRT-LLM)
        for rid in meta.finished:
            self._requests.pop(rid, None)
        for item in meta.requests:
            state = self._requests.setdefault(item.request_id, _WorkerRequest())
            state.keys.extend(item.new_keys)
            state.block_ids.extend(item.new_block_ids)
            if item.load_num_blocks and item.load_async:
                self._async_loads[item.request_id] = item
            elif item.load_num_blocks:
                self._load(item, state, stream)

    def _load(self, item: RequestMeta, state: _WorkerRequest, stream: Any, *, by_layer: bool = True) -> None:
        assert self._engine is not None
        B = self._engine.layout.tokens_per_block
        want = (item.load_skip_blocks + item.load_num_blocks) * B
        args = dict(keys=state.keys, skip_blocks=item.load_skip_blocks, num_blocks=item.load_num_blocks,
                    lease=item.request_id, stream=stream)
        if by_layer and self._may_load_by_layer():
            got, layered = self._engine.retrieve_by_layer(None, state.block_ids, **args)
            if layered is not None:
                self._layered.append(layered)
        else:
            got = self._engine.retrieve(None, state.block_ids, **args)
        if got != want:  # only possible if a lease expired before its load: never silent
            logger.error("kvdepot: req=%s loaded %d of %d tokens; lease expired before the load", item.request_id, got, want)

    def _may_load_by_layer(self) -> bool:
        """Whether this forward's hits may be loaded by layer: configured so, and a whole forward's
        layer hooks have been seen to fire in order (and none has skipped one since)."""
        assert self._engine is not None
        return self._hooks_fire and not self._hooks_failed and self._engine.config.load_by_layer == "auto"

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Make the forward stream wait for layer ``layer_idx`` of this step's layered loads (whole
        loads were already waited for in ``start_load_kv``), and note that the hooks fire. Layered
        loads enqueue their next layers here. One whose copies could not be enqueued raises
        ``TransferFailed`` (after the others are waited for): its blocks hold no valid KV, and a
        forward that went on would read them."""
        self._hook_layers = self._hook_layers + 1 if layer_idx == self._hook_layers else int(layer_idx == 0)
        failed: TransferFailed | None = None
        for load in self._layered:
            try:
                load.wait_layer(layer_idx, stream)
            except TransferFailed as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def _settle_layered(self, stream: Any) -> None:
        """End of a forward: every layered load must have been waited for layer by layer. One that
        was not is waited for wholly now, so nothing later on ``stream`` (saves, the blocks' next
        owner) can run ahead of its copies; if a layer's attention ran before its copies, that
        forward read stale KV, so it is logged as an error and layered loads stop for good."""
        for load in self._layered:
            if not load.fully_waited:
                try:
                    load.wait_all(stream)
                except TransferFailed:  # logged where it failed; a forward that waited heard of it
                    continue
                if not self._hooks_failed:
                    logger.error("kvdepot: a layered load's layers were not all waited for by the forward "
                                 "(wait_for_layer_load calls missing); loads are whole from now on")
                self._hooks_failed = True
        self._layered.clear()

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Whole blocks are saved after the forward pass (noted in wait_for_save); nothing per layer."""

    def wait_for_save(self, stream: Any) -> None:
        """Note this step's saves; they are enqueued at the next ``get_finished``, after sampling.

        Why not here: the store's device->host copies and the sampler's copy of the new token
        share the GPU's copy engine. Enqueued here, behind an event at the end of the forward,
        a 512 MB store runs first and the first token waits ~10 ms for it (measured: +8.4% TTFT
        on a 4K-token miss). Enqueued in ``get_finished`` — after sampling, before the executor
        can free or reuse any block — the store still never makes the forward stream wait.
        """
        if self._engine is not None and self._hook_layers >= self._engine.layout.num_layers:
            self._hooks_fire = True  # every layer's hook ran, in order, during this forward (draft layers may follow)
        self._hook_layers = 0
        self._settle_layered(stream)
        meta = self._meta()
        if meta is None:
            return
        self._submit_saves()  # a step without get_finished (never in TensorRT-LLM) still saves
        bpc = self._engine.layout.blocks_per_chunk  # type: ignore[union-attr]
        for item in meta.requests:
            state = self._requests.get(item.request_id)
            if state is None or item.save_upto_chunks <= state.saved:
                continue
            first, upto = state.saved, item.save_upto_chunks
            self._pending_saves.append((state, state.block_ids[first * bpc : upto * bpc], state.keys[first:upto]))
            state.saved = upto
        self._save_stream = stream

    def _submit_saves(self) -> None:
        """Enqueue the noted saves behind an event recorded now on the forward stream."""
        pending, self._pending_saves = self._pending_saves, []
        if self._engine is None:
            return
        for state, block_ids, keys in pending:
            state.handles.append(self._engine.store(None, block_ids, keys=keys, stream=self._save_stream))

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Report each finished request once, when every store it issued has completed, and each
        parked request once its promoted chunks are loaded."""
        self._submit_saves()
        self._finishing.update(finished_gen_req_ids)
        loaded = self._progress_async_loads(started_loading_req_ids)
        return take_saved(self._finishing, self._requests), loaded

    def _progress_async_loads(self, started: list[int]) -> list[int]:
        """Load the parked requests whose promotion finished (on the current stream's order)."""
        assert self._engine is not None or not self._async_loads
        for rid, item in list(self._async_loads.items()):
            if self._engine is not None and self._engine.promotion_done(rid):
                del self._async_loads[rid]
                self._load(item, self._requests[rid], None, by_layer=False)  # read by a later forward
                self._loaded.add(rid)
        self._started.update(started)
        ready = [rid for rid in self._loaded if rid in self._started]
        for rid in ready:
            self._loaded.discard(rid)
            self._started.discard(rid)
        return ready
