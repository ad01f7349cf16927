"""The vLLM connector's scheduler role: lookups, and what the worker loads and saves each step.

    matched(request, num_computed_tokens)           get_num_new_matched_tokens: keys once, probe
        -> (tokens, load_async)                      under a lease (leaving one token to compute);
                                                     async where part of the hit is on disk/Redis
    after_alloc(request, blocks, num_external)      update_state_after_alloc: the load vLLM took
    build_meta(scheduler_output) -> metadata        deltas: new keys and blocks, this step's load,
                                                     the chunks computed after this step
    finished(request) -> bool                       request_finished: True while saves may run

The deltas come from the step planner the TensorRT-LLM connector uses too (``integrations/planner.py``);
this role only turns vLLM's scheduler output into its inputs and its deltas into vLLM items. Where
the engine lives — the worker's ``CacheEngine`` in this process, or a lookups-only registration
with ``kvdepot server`` — is the provider's (``providers.py``), as are the lease ids and when a
deployment cannot use kvdepot in that mode.

Hits found only on disk or in Redis (``lower_tier_hits: load``, the default) are served to the
request that found them: ``matched`` returns ``(n, True)``, vLLM parks the request
(``WAITING_FOR_REMOTE_KVS``) and allocates its blocks, and the next ``build_meta`` sends the
load flagged ``load_async`` although vLLM did not schedule the request; the worker loads once
the probe's promotion is in host memory and reports it in ``finished_recving``
(``async_loads.py``). Blocks it could not fill go to ``get_block_ids_with_load_errors``, and
vLLM 0.32 (``Scheduler._handle_invalid_blocks``) truncates the request at the first of them and
recomputes from there — with ``kv_load_failure_policy: recompute``. Under vLLM's default
``fail`` it would fail the request instead, so there ``matched`` answers None (vLLM asks again
next step) until the promotion is done and then promises only what is in host memory
(``lower_tier_mode``). In both, a lower-tier part expected to be slower to read than to recompute
is neither promised nor waited for (``load_gate.py``, config ``lower_tier_gate``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from kvdepot.engine_api import Engine, Lease
from kvdepot.integrations.load_gate import LoadGate
from kvdepot.integrations.planner import DeltaPlanner, SentState
from kvdepot.integrations.vllm.metadata import KvDepotVllmMetadata, VllmRequestMeta
from kvdepot.integrations.vllm.setup import Setup, logger
from kvdepot.keys import ChunkHasher

# "wait" mode: how long a lookup may answer None for its promotion before it settles for the host
# part (promotions are bounded by the tiers' timeouts; this only caps a slow disk or Redis).
WAIT_PROMOTION_S = 5.0


@dataclass(kw_only=True)
class SchedRequest(SentState):
    """What the scheduler role knows of one live request: the planner's sent-state plus vLLM's request."""

    request: Any  # vLLM's Request: its token list grows in place during decode
    hasher: ChunkHasher
    skip_blocks: int = 0  # where a load would start (blocks vLLM holds already)
    reset: bool = True  # a new lookup: the worker drops whatever it held under this id
    load_async: bool = False  # the load reaches past the host part: vLLM parks the request for it


class Scheduler:
    def __init__(self, setup: Setup) -> None:
        self._setup = setup
        self._provider = setup.provider()
        self._block = setup.block
        self._requests: dict[str, SchedRequest] = {}
        self._hashers: dict[tuple[str, str, bytes], ChunkHasher] = {}
        self._loads = setup.loads
        self._planner = DeltaPlanner(self._block, saves=setup.saves)
        self._gate = LoadGate.from_config(setup.config)
        self._disabled_reason = "unsupported KV cache groups" if setup.group is None else self._provider.why_off()
        if self._disabled_reason:
            logger.warning("kvdepot: %s; kvdepot is off (no lookups, no saves)", self._disabled_reason)
        self._lower = lower_tier_mode(setup) if self._loads else "off"
        self._waiting: dict[str, float] = {}  # lookups waiting for their promotion ("wait"), until when
        self._parked: list[str] = []  # async loads vLLM allocated blocks for: sent, unscheduled, next step

    def _engine(self) -> Engine | None:
        """The engine to look up in, or None: no hits, no saves."""
        return None if self._disabled_reason else self._provider.scheduler_engine()

    def _lease(self, rid: str) -> Lease:
        return Lease(self._provider.lease_id(rid))

    def _hasher(self, engine: Engine, request: Any) -> ChunkHasher:
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
            hasher = self._hashers[(salt, lora_id, base.seed)] = ChunkHasher(ns, base.algo)
        return hasher

    @staticmethod
    def _cacheable(request: Any) -> bool:
        """Token ids must decide the KV: no multimodal inputs, no prompt embeddings."""
        return (
            getattr(request, "prompt_token_ids", None) is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
        )

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        engine = self._engine()
        waiting = self._waiting.pop(rid, None)
        if (waiting is not None and engine is not None and time.monotonic() < waiting
                and not engine.promotion_done(self._lease(rid))):
            self._waiting[rid] = waiting
            return None, False  # vLLM asks again next step: the promotion runs on meanwhile
        old = self._requests.pop(rid, None)
        if old is not None and engine is not None and waiting is None:
            engine.release(self._lease(rid))  # vLLM asks again when it could not schedule the request
        if engine is None or not self._cacheable(request) or num_computed_tokens % self._block:
            return 0, False
        tokens = list(request.all_token_ids)
        hasher = self._hasher(engine, request)
        state = SchedRequest(int(request.num_prompt_tokens), hasher.chunk_keys(tokens), request=request, hasher=hasher)
        engine.describe(state.keys, tokens)  # the edge: the KV events announce only chunks with known tokens
        state.skip_blocks = num_computed_tokens // self._block
        self._requests[rid] = state
        started = time.perf_counter()
        hit = engine.probe(state.keys, skip_tokens=num_computed_tokens, lease=self._lease(rid))
        probe_ms = round((time.perf_counter() - started) * 1e3, 3)
        # lower_tier_gate: a lower-tier part slower to read than to recompute is not waited for
        worth = waiting is not None or not hit.pending or self._gate.worth_loading(
            hit.tokens - hit.host_tokens, hit.read_tokens_per_s)
        if self._lower == "wait" and hit.pending and waiting is None and worth:
            # kv_load_failure_policy: fail — promise only what is in host memory, once promoted.
            self._waiting[rid] = time.monotonic() + WAIT_PROMOTION_S
            self._setup.stats.write("lookup_wait", req=rid, tokens=len(tokens), vllm_matched=num_computed_tokens,
                                    cached=hit.tokens, host=hit.host_tokens, ms=probe_ms)
            return None, False
        # Host memory serves this request; so do chunks found only on disk/Redis with
        # lower_tier_hits: load (loaded asynchronously once promoted), else they are promoted in
        # the background for later requests (prefetch). At least one token to compute: vLLM
        # needs one to produce the next token.
        limit = (len(tokens) - 1) // self._block * self._block
        usable = (hit.tokens if self._lower == "async" and worth else hit.host_tokens) if self._loads else 0
        matched = max(0, min(usable, limit) - num_computed_tokens) // self._block * self._block
        state.load_async = num_computed_tokens + matched > hit.host_tokens
        if matched:
            state.load = (state.skip_blocks, matched // self._block)
        else:
            engine.release(self._lease(rid))  # a promotion it started runs on as a prefetch
        logger.info("lookup req=%s vllm_matched=%d cached=%d new_matched=%d host=%d async=%s", rid,
                    num_computed_tokens, hit.tokens, matched, hit.host_tokens, bool(matched and state.load_async))
        self._setup.stats.write(
            "lookup", req=rid, tokens=len(tokens), vllm_matched=num_computed_tokens, cached=hit.tokens,
            host=hit.host_tokens, new_matched=matched, load_async=bool(matched and state.load_async), ms=probe_ms,
            recompute_faster=not worth,
        )
        return matched, bool(matched and state.load_async)

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
            if state.load_async:  # vLLM parks the request: it is not scheduled until we report the load
                state.block_ids = list(blocks.get_block_ids()[0])
                self._parked.append(request.request_id)

    def build_meta(self, scheduler_output: Any) -> KvDepotVllmMetadata:
        meta = KvDepotVllmMetadata(preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                                   lease_session=self._provider.session(), lease_token=self._provider.lease_token())
        for rid in meta.preempted:
            # vLLM freed its blocks and the worker drops its state: whatever it saved is
            # cached already, and request_finished must not hold blocks it no longer has.
            state = self._requests.get(rid)
            if state is not None:
                state.forget()
        self._gate.step(sum(scheduler_output.num_scheduled_tokens.values()))
        engine = self._engine()
        if engine is None:
            return meta
        parked, self._parked = self._parked, []
        for rid in parked:  # async loads: sent now, before vLLM schedules the requests; nothing saved
            state = self._requests.get(rid)
            if state is not None:
                self._plan(engine, rid, state, 0, meta, load_async=True)
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

    def _plan(self, engine: Engine, rid: str, state: SchedRequest, computed: int, meta: KvDepotVllmMetadata,
              load_async: bool = False) -> None:
        """The shared planner's delta for this step, as vLLM's item (plus its reset flag)."""
        request = state.request
        planned = self._planner.plan(
            rid, state, computed, request.num_tokens, chunk_size=engine.layout.chunk_size,
            save_decode=engine.config.save_decode_cache,
            more_keys=lambda: state.hasher.extend(state.keys, list(request.all_token_ids)),
        )
        if planned is not None:
            meta.requests.append(VllmRequestMeta(**vars(planned.delta), reset=planned.reset, load_async=load_async))

    def finished(self, request: Any) -> bool:
        """True while the request's saves may still be copying: vLLM keeps its blocks until get_finished."""
        rid = request.request_id
        state = self._requests.pop(rid, None)
        self._waiting.pop(rid, None)
        engine = self._engine()
        if engine is not None:
            engine.release(self._lease(rid))
        return bool(state is not None and state.known and state.saved_upto)

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """The workers' registrations (vLLM's handshake metadata): server mode registers their geometry."""
        if not self._disabled_reason:
            self._provider.set_handshake(metadata)

    def shutdown(self) -> None:
        """vLLM is closing the scheduler: server mode ends its session (the server drops its leases)."""
        self._provider.close()


def lower_tier_mode(setup: Setup) -> str:
    """How hits found only on disk/Redis are served to the request that found them.

    ``off`` (``lower_tier_hits: prefetch``): not at all; promoted for later requests.
    ``async``: promised at once with ``load_kv_async``, where vLLM recomputes the blocks a load
    could not fill (``kv_load_failure_policy: recompute``).
    ``wait``: under vLLM's default ``fail``, which would fail the request for a chunk lost between
    lookup and load (evicted, corrupt, Redis down): ``matched`` answers None (vLLM asks again next
    step) until the promotion is done, then promises only what is in host memory, loaded like any
    host hit. A failed promotion is then a shorter hit, never a failed request."""
    if setup.config.lower_tier_hits == "prefetch":
        return "off"
    policy = getattr(setup.vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    return "async" if policy == "recompute" else "wait"
