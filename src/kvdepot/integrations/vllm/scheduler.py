"""The connector's scheduler role, in-process mode: lookups in the engine the worker registered.

    matched(request, num_computed_tokens) -> int    get_num_new_matched_tokens: keys once, probe
                                                     under a lease (leaving one token to compute)
    after_alloc(request, blocks, num_external)      update_state_after_alloc: the load vLLM took
    build_meta(scheduler_output) -> metadata        deltas: new keys and blocks, this step's load,
                                                     the chunks computed after this step
    finished(request) -> bool                       request_finished: True while saves may run

The deltas come from the step planner the TensorRT-LLM adapter uses too (``integrations/planner.py``);
this role only turns vLLM's scheduler output into its inputs and its deltas into vLLM items. Server mode
(``server_mode.RemoteScheduler``) subclasses it and overrides only where the engine lives
(``_engine``), what a lease is called on it (``_lease``), and when kvdepot must stay off.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

from kvdepot.integrations.planner import DeltaPlanner, SentState
from kvdepot.integrations.vllm.common import Setup, logger
from kvdepot.integrations.vllm.layout import current_engine
from kvdepot.integrations.vllm.metadata import KvDepotVllmMetadata, VllmRequestMeta
from kvdepot.keys import ChunkHasher

IN_PROCESS_BACKENDS = ("uni", "external_launcher")


@dataclass(kw_only=True)
class SchedRequest(SentState):
    """What the scheduler role knows of one live request: the planner's sent-state plus vLLM's request."""

    request: Any  # vLLM's Request: its token list grows in place during decode
    hasher: ChunkHasher
    skip_blocks: int = 0  # where a load would start (blocks vLLM holds already)
    reset: bool = True  # a new lookup: the worker drops whatever it held under this id


class Scheduler:
    def __init__(self, setup: Setup) -> None:
        self._setup = setup
        self._block = setup.block
        self._requests: dict[str, SchedRequest] = {}
        self._hashers: dict[tuple[str, str, bytes], ChunkHasher] = {}
        self._loads = setup.loads
        self._planner = DeltaPlanner(self._block, saves=setup.saves)
        self._disabled_reason = "unsupported KV cache groups" if setup.group is None else self._why_off()
        if self._disabled_reason:
            logger.warning("kvdepot: %s; kvdepot is off (no lookups, no saves)", self._disabled_reason)

    # ---- what server mode overrides ----------------------------------------------------------
    def _why_off(self) -> str:
        """Why this deployment cannot use kvdepot (empty: it can)."""
        parallel = self._setup.vllm_config.parallel_config
        backend = getattr(parallel, "distributed_executor_backend", None)
        if int(getattr(parallel, "world_size", 1) or 1) > 1:
            return f"world_size={parallel.world_size}: in-process mode sees one worker's cache only (use kvdepot server)"
        if backend not in IN_PROCESS_BACKENDS:
            return (f"distributed_executor_backend={backend!r} runs the worker in another process; in-process mode "
                    "needs 'uni' (on CPU: set VLLM_ENABLE_V1_MULTIPROCESSING=0), or use kvdepot server (server_url)")
        return ""

    def _engine(self) -> Any:
        """The engine to look up in (a ``CacheEngine`` here), or None: no hits, no saves."""
        return None if self._disabled_reason else current_engine()

    def _lease(self, rid: str) -> Hashable:
        return rid

    def _hash_algo(self, engine: Any) -> str:
        return engine.config.hash_algo

    # ---- vLLM's calls ---------------------------------------------------------------------------
    def _hasher(self, engine: Any, request: Any) -> ChunkHasher:
        """Keys of a request with a cache salt or a LoRA adapter live in their own namespace."""
        salt = getattr(request, "cache_salt", None) or ""
        lora = getattr(request, "lora_request", None)
        lora_id = f"{getattr(lora, 'lora_name', '')}#{getattr(lora, 'lora_int_id', '')}" if lora is not None else ""
        base: ChunkHasher = engine.hasher
        if not salt and not lora_id:
            return base
        hasher = self._hashers.get((salt, lora_id, base.seed))
        if hasher is None:
            ns = replace(base.namespace, cache_salt=f"{base.namespace.cache_salt}\0salt={salt}\0lora={lora_id}")
            hasher = self._hashers[(salt, lora_id, base.seed)] = ChunkHasher(ns, self._hash_algo(engine))
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
            engine.release(self._lease(rid))  # vLLM asks again when it could not schedule the request
        if engine is None or not self._cacheable(request) or num_computed_tokens % self._block:
            return 0
        tokens = list(request.all_token_ids)
        hasher = self._hasher(engine, request)
        state = SchedRequest(int(request.num_prompt_tokens), hasher.chunk_keys(tokens), request=request, hasher=hasher)
        engine.describe(state.keys, tokens)  # the edge: the KV events announce only chunks with known tokens
        state.skip_blocks = num_computed_tokens // self._block
        self._requests[rid] = state
        started = time.perf_counter()
        hit = engine.probe(keys=state.keys, skip_tokens=num_computed_tokens, lease=self._lease(rid))
        probe_ms = round((time.perf_counter() - started) * 1e3, 3)
        # Host memory serves this request; chunks found only on disk/Redis are promoted in the
        # background for later requests (lower_tier_hits: prefetch, always exact).
        # At least one token to compute: vLLM needs one to produce the next token.
        limit = (len(tokens) - 1) // self._block * self._block
        usable = hit.host_tokens if self._loads else 0
        matched = max(0, min(usable, limit) - num_computed_tokens) // self._block * self._block
        if matched:
            state.load = (state.skip_blocks, matched // self._block)
        else:
            engine.release(self._lease(rid))  # a promotion it started runs on as a prefetch
        logger.info("lookup req=%s vllm_matched=%d cached=%d new_matched=%d", rid, num_computed_tokens, hit.tokens, matched)
        self._setup.stats.write(
            "lookup", req=rid, tokens=len(tokens), vllm_matched=num_computed_tokens, cached=hit.tokens,
            host=hit.host_tokens, new_matched=matched, ms=probe_ms,
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
                    engine.release(self._lease(request.request_id))
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
                state.forget()
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
                state.resend(list(new_ids[0]) if new_ids else [])
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(engine, rid, state, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        return meta

    def _plan(self, engine: Any, rid: str, state: SchedRequest, computed: int, meta: KvDepotVllmMetadata) -> None:
        """The shared planner's delta for this step, as vLLM's item (plus its reset flag)."""
        request = state.request
        planned = self._planner.plan(
            rid, state, computed, request.num_tokens, chunk_size=engine.layout.chunk_size,
            save_decode=engine.config.save_decode_cache,
            more_keys=lambda: state.hasher.extend(state.keys, list(request.all_token_ids)),
        )
        if planned is not None:
            meta.requests.append(VllmRequestMeta(**vars(planned.delta), reset=planned.reset))

    def finished(self, request: Any) -> bool:
        """True while the request's saves may still be copying: vLLM keeps its blocks until get_finished."""
        rid = request.request_id
        state = self._requests.pop(rid, None)
        engine = self._engine()
        if engine is not None:
            engine.release(self._lease(rid))
        return bool(state is not None and state.known and state.saved_upto)

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """The workers' registrations (vLLM's handshake metadata); in-process mode needs none."""

    def shutdown(self) -> None:
        """vLLM is closing the scheduler; in-process mode holds nothing of its own."""
