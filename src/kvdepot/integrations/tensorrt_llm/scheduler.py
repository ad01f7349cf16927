"""The TensorRT-LLM connector's scheduler half (rank 0): what each request loads and saves.

    get_num_new_matched_tokens -> keys once, engine.probe under the request's lease
    update_state_after_alloc   -> the request's prompt blocks (an async load starts from them)
    build_connector_meta       -> KvDepotMetadata: deltas, this step's load, chunks computed after it
    request_finished           -> True while saves may still copy: TensorRT-LLM keeps the blocks

The engine comes from the provider (``providers.py``): in-process, the ``CacheEngine`` the worker
registered; in server mode, the worker's ``RemoteEngine`` (LOOKUP + QUERY_PREFETCH_STATUS answer
``probe``, and every TP rank must hold a chunk for it to count). Either way the answer is "no hit"
until the worker has registered.

Only bytes already in host memory, pinned under the request's lease, are ever promised, and always
synchronously (``is_async=False``): TensorRT-LLM 1.2 cannot take a promised load back, and every
way a promise can end short there is unsafe (an error in the forward fails the step's requests
and stores their unwritten blocks in its own prefix tree for device reuse; a parked request that
is cancelled is stored the same way; docs/tensorrt-llm.md has the evidence). So a hit partly on
disk or in Redis, with ``lower_tier_hits: load`` (the default), makes the lookup wait — bounded
by ``lower_tier_wait_s`` — while the probe's promotion reads it into host slots, then promises
what arrived: a chunk gone, corrupt or unreachable before the promise is simply not promised (the
engine recomputes it). The lookup does not wait where recomputing is expected to be faster than
the read (``load_gate.py``, config ``lower_tier_gate``), nor with ``prefetch``: the promotion then
serves later requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from kvdepot.engine_api import Engine, Hit, Lease
from kvdepot.integrations.load_gate import LoadGate
from kvdepot.integrations.planner import DeltaPlanner, SentState
from kvdepot.integrations.tensorrt_llm.api import KvCacheConnectorScheduler, SchedulerOutput
from kvdepot.integrations.tensorrt_llm.metadata import KvDepotMetadata, RequestMeta
from kvdepot.integrations.tensorrt_llm.setup import Setup

logger = logging.getLogger("kvdepot")


@dataclass(kw_only=True)
class _SchedRequest(SentState):
    """What the scheduler knows of one live request: the planner's sent-state plus its tokens."""

    tokens: list[int]


class KvDepotScheduler(KvCacheConnectorScheduler):
    """Decides, per request, which blocks kvdepot loads and which chunks it saves."""

    server: ClassVar[bool | None] = None  # None: the mode by configuration; True/False pins it

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        setup = Setup.from_llm_args(llm_args, server=self.server)
        self._provider = setup.provider()
        self._block = setup.tokens_per_block
        self._tp_size = setup.tp_size
        self._requests: dict[int, _SchedRequest] = {}
        self._planner = DeltaPlanner(self._block)
        self._gate = LoadGate.from_config(setup.config)
        self._finished: list[int] = []
        self._warned_tp = False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = int(request.request_id)
        engine = self._provider.current()
        tokens = list(request.get_tokens(0))
        if engine is None or self._refuse_tp() or num_computed_tokens % self._block:
            logger.info("lookup req=%s trt_matched=%d cached=0 new_matched=0", rid, num_computed_tokens)
            return 0, False
        if rid in self._requests:
            logger.warning("kvdepot: request id %s seen again before it finished; its old state is dropped", rid)
            engine.release(Lease(rid))
        state = _SchedRequest(getattr(request, "prompt_len", len(tokens)), engine.chunk_keys(tokens), tokens=tokens)
        self._requests[rid] = state
        hit = engine.probe(state.keys, skip_tokens=num_computed_tokens, lease=Lease(rid))
        waited, gated = 0.0, False
        if hit.pending and engine.config.lower_tier_hits == "load":
            gated = not self._gate.worth_loading(hit.tokens - hit.host_tokens, hit.read_tokens_per_s)
            if not gated:  # else the promotion is a prefetch: recomputing is expected to be faster
                hit, waited = self._await_promotion(engine, state, num_computed_tokens, Lease(rid))
                self._gate.exclude(waited)
        # Leave at least one prompt token to compute (TensorRT-LLM checks prepopulated < prompt_len).
        limit = (state.prompt_len - 1) // self._block * self._block
        matched = max(0, min(hit.host_tokens, limit) - num_computed_tokens) // self._block * self._block
        if matched:
            state.load = (num_computed_tokens // self._block, matched // self._block)
        else:
            engine.release(Lease(rid))  # a promotion it started runs on as a prefetch
        logger.info("lookup req=%s trt_matched=%d cached=%d new_matched=%d%s%s", rid, num_computed_tokens, hit.tokens,
                    matched, f" (waited {waited * 1e3:.1f} ms for lower tiers)" if waited else "",
                    " (recompute is faster)" if gated else "")
        return matched, False

    @staticmethod
    def _await_promotion(engine: Engine, state: _SchedRequest, skip: int, lease: Lease) -> tuple[Hit, float]:
        """Wait (at most ``lower_tier_wait_s``) for the probe's promotion, then look the prefix up
        again under the same lease: its answer's host part is what is now read, verified and pinned.

        Why the scheduler waits: the alternative, a promise before the bytes are in host memory,
        has no safe ending on TensorRT-LLM 1.2 if a read then fails (module docstring). The wait is
        the read the request would wait for anyway; other requests' steps wait with it, which a
        recompute of the same prefix (a prefill step) would also make them do, for longer where
        reading is faster than recomputing."""
        started = time.monotonic()
        deadline = started + engine.config.lower_tier_wait_s
        pause = 0.0002
        while not engine.promotion_done(lease) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.002)
        hit = engine.probe(state.keys, skip_tokens=skip, lease=lease)
        return hit, time.monotonic() - started

    def _refuse_tp(self) -> bool:
        """An engine that sees only this rank's cache never claims a hit under TP (other ranks may miss)."""
        refuse = self._tp_size > 1 and not self._provider.sees_all_ranks
        if refuse and not self._warned_tp:
            logger.warning("kvdepot: tensor_parallel_size>1 needs the multi-process adapter (kvdepot server); in-process hits are off")
            self._warned_tp = True
        return refuse

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        state = self._requests.get(int(request.request_id))
        if state is not None:
            state.block_ids = list(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvDepotMetadata:
        meta = KvDepotMetadata(finished=self._finished, lease_session=self._provider.session(),
                               lease_token=self._provider.lease_token())
        self._finished = []
        self._gate.step(sum(d.num_scheduled_tokens for d in (*scheduler_output.new_requests, *scheduler_output.cached_requests)))
        engine = self._provider.current()
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
        return meta

    def _plan(self, engine: Engine, rid: int, state: _SchedRequest, computed: int, meta: KvDepotMetadata) -> None:
        """The shared planner's delta for this step, as TensorRT-LLM's item (plus the async-load flag)."""
        hasher = engine.hasher
        planned = self._planner.plan(
            rid, state, computed, len(state.tokens), chunk_size=engine.layout.chunk_size,
            save_decode=engine.config.save_decode_cache, more_keys=lambda: hasher.extend(state.keys, state.tokens),
        )
        # NOTE: a lookup here never promises 0 blocks, so a load in the delta is the one it promised.
        if planned is not None:
            meta.requests.append(RequestMeta(**vars(planned.delta)))

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True while the request's saves may still be copying: keep its blocks until get_finished."""
        rid = int(request.request_id)
        state = self._requests.pop(rid, None)
        engine = self._provider.current()
        if engine is not None:
            engine.release(Lease(rid))
        if state is None or not state.known:
            return False
        if state.saved_upto:
            return True
        self._finished.append(rid)
        return False
