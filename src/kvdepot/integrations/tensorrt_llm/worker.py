"""The TensorRT-LLM connector's worker half (every rank): moves whole blocks between the pool and kvdepot.

    register_kv_caches -> provider.attach(pool): the process's engine over this rank's pool
    start_load_kv      -> the step's deltas; synchronous loads (by layer where allowed)
    wait_for_layer_load-> the forward stream waits for layer i of this forward's layered loads
    wait_for_save      -> notes the step's saves (enqueued at get_finished, after sampling)
    get_finished       -> saves enqueued; requests whose saves completed; parked loads done

The engine is the provider's (``providers.py``): a ``CacheEngine`` copies here on its side streams,
a ``RemoteEngine`` has ``kvdepot server`` copy (CUDA IPC, a shared file, or bytes over the socket).
Both answer the same calls (``engine_api.Engine``); what the worker branches on is declared in
``engine.capabilities``.

Loads by layer (``load_by_layer: auto``, where the engine can): the load is copied layer by layer
(in-process a few layers ahead of the hooks, ``transfer/layered.py``; in server mode by the server
before it answers) and ``wait_for_layer_load(i)`` makes the forward stream wait only for layer
``i``, so a hit's copies overlap the forward over the new tokens. Only once a whole forward's
layer hooks were seen to fire, and never again after one was missed (``layer_hooks.py``).

Parked (asynchronous) loads (``lower_tier_hits: load``, a hit partly below host memory): an
engine that loads asynchronously (the server holds the load until its promotion is done) gets the
load at once; otherwise the worker waits for the promotion (``promotion_done``) and then loads,
for a later forward. ``get_finished`` reports the request once the load is answered.

A promise that came up short (a chunk gone or corrupt in every tier that had it, the server gone):
TensorRT-LLM 1.2 cannot take it back, and the request would compute from blocks that do not hold
its KV. The worker reports it loaded anyway (never parked forever), counts it
(``stats.failed_promises``), logs one error, and raises ``PromisedLoadFailed`` in the first layer
hook (or ``wait_for_save``) of the step that schedules it: 1.2 answers the step's requests with an
error response. Nothing that step computed is saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvdepot.engine_api import Engine, Lease, PendingLoad, PendingStore
from kvdepot.errors import PromisedLoadFailed
from kvdepot.integrations.saves import take_saved
from kvdepot.integrations.tensorrt_llm.api import KvCacheConnectorWorker
from kvdepot.integrations.tensorrt_llm.layer_hooks import LayerHooks
from kvdepot.integrations.tensorrt_llm.metadata import KvDepotMetadata, RequestMeta
from kvdepot.integrations.tensorrt_llm.setup import Setup

logger = logging.getLogger("kvdepot")


@dataclass
class _WorkerRequest:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks already handed to engine.store
    handles: list[PendingStore] = field(default_factory=list)


@dataclass
class _ParkedLoad:
    """A load TensorRT-LLM parked (``is_async``): sent once the engine may take it, reported once answered."""

    item: RequestMeta
    lease: Lease
    pending: PendingLoad | None = None  # sent
    want: int = 0  # tokens the load was promised to make valid


@dataclass
class WorkerStats:
    """What this rank's worker counted (the engine's own counters are in ``engine.stats()``)."""

    parked_loads: int = 0  # loads promised with is_async (a hit partly below host memory)
    failed_promises: int = 0  # promised loads that came up short: their step got an error


class KvDepotWorker(KvCacheConnectorWorker):
    """Moves whole blocks between TensorRT-LLM's pool and kvdepot, off the forward stream."""

    server: ClassVar[bool | None] = None  # None: the mode by configuration; True/False pins it

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._provider = Setup.from_llm_args(llm_args, server=self.server).provider()
        self._engine: Engine | None = None
        self._requests: dict[int, _WorkerRequest] = {}
        self._finishing: set[int] = set()
        self._parked: dict[int, _ParkedLoad] = {}  # async loads, until reported
        self._started: set[int] = set()  # async loads TensorRT-LLM has seen start (get_finished's argument)
        self._pending_saves: list[tuple[_WorkerRequest, list[int], list[bytes]]] = []  # noted, not enqueued
        self._save_stream: Any = None
        self._hooks = LayerHooks()
        self.stats = WorkerStats()
        self._broken: dict[int, str] = {}  # short promised loads whose request has not run yet
        self._doomed: list[str] = []  # this step schedules these broken requests: its forward fails
        self._step_failed = False  # this step's forward raised: none of its saves are noted

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self._engine = self._provider.attach(kv_cache_tensor)
        self._requests.clear()

    def _meta(self) -> KvDepotMetadata | None:
        meta = self._metadata  # None on ranks where the broadcast gave nothing (tolerated)
        return meta if isinstance(meta, KvDepotMetadata) else None

    def start_load_kv(self, stream: Any) -> None:
        meta, engine = self._meta(), self._engine
        if meta is None or engine is None:
            return
        self._submit_saves()
        self._hooks.settle(stream)  # a forward that never came (never in TensorRT-LLM)
        self._step_failed = False
        for rid in meta.finished:
            self._requests.pop(rid, None)
            self._broken.pop(rid, None)
        for item in meta.requests:
            state = self._requests.setdefault(item.request_id, _WorkerRequest())
            state.keys.extend(item.new_keys)
            state.block_ids.extend(item.new_block_ids)
            lease = Lease(item.request_id, session=meta.lease_session, token=meta.lease_token)
            if item.load_num_blocks and item.load_async:
                self._parked[item.request_id] = _ParkedLoad(item, lease)
                self.stats.parked_loads += 1
            elif item.load_num_blocks:
                self._load(engine, item, state, lease, stream)
        self._doomed = [self._broken.pop(rid) for rid in meta.new_request_ids if rid in self._broken]
        if engine.capabilities.async_loads:  # the engine holds each until its promotion is done
            for parked in self._parked.values():
                if parked.pending is None:
                    self._send(engine, parked, stream)

    def _load(self, engine: Engine, item: RequestMeta, state: _WorkerRequest, lease: Lease, stream: Any) -> None:
        args: dict[str, Any] = dict(skip_blocks=item.load_skip_blocks, num_blocks=item.load_num_blocks,
                                    lease=lease, stream=stream)
        if self._may_load_by_layer(engine):
            got, layered = engine.retrieve_by_layer(state.keys, state.block_ids, **args)
            if layered is not None:
                self._hooks.add(layered)
        else:
            got = engine.retrieve(state.keys, state.block_ids, **args)
        self._check_load(item.request_id, got, self._want(engine, item))

    def _check_load(self, rid: int, got: int, want: int) -> None:
        """A load shorter than its promise: the request must fail, never compute from it."""
        if got >= want:
            return
        # a chunk lost after the lookup, a lease that expired, or the server went away
        self.stats.failed_promises += 1
        self._broken[rid] = f"req={rid} loaded {got} of {want} promised tokens"
        logger.error("kvdepot: req=%s loaded %d of %d promised tokens; its next forward fails with an "
                     "error (TensorRT-LLM cannot take a promised load back)", rid, got, want)

    def _fail_step(self) -> None:
        """Raise in the forward of a step that schedules a request whose promised load was short."""
        if self._doomed:
            doomed, self._doomed = self._doomed, []
            self._step_failed = True
            raise PromisedLoadFailed("kvdepot: " + "; ".join(doomed) + ": the rest of the prefix is not valid "
                                     "KV, so the step fails instead of computing from it")

    def _send(self, engine: Engine, parked: _ParkedLoad, stream: Any) -> None:
        item = parked.item
        parked.pending = engine.retrieve_async(
            self._requests[item.request_id].keys, self._requests[item.request_id].block_ids,
            skip_blocks=item.load_skip_blocks, num_blocks=item.load_num_blocks, lease=parked.lease, stream=stream,
        )
        parked.want = self._want(engine, item)

    @staticmethod
    def _want(engine: Engine, item: RequestMeta) -> int:
        return (item.load_skip_blocks + item.load_num_blocks) * engine.layout.tokens_per_block

    def _may_load_by_layer(self, engine: Engine) -> bool:
        """Configured so, and a whole forward's layer hooks seen (none missed since). The engine
        still decides: one that cannot load by layer answers a whole load."""
        return self._hooks.allowed and engine.config.load_by_layer == "auto"

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Make the forward stream wait for layer ``layer_idx`` of this step's layered loads (whole
        loads were already waited for in ``start_load_kv``). Raises ``TransferFailed`` if a load's
        copies could not be enqueued, ``PromisedLoadFailed`` if the step schedules a request whose
        promised load came up short: their blocks hold no valid KV, and the forward must not go on."""
        self._fail_step()
        try:
            self._hooks.wait_layer(layer_idx, stream)
        except Exception:
            self._step_failed = True
            raise

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
        engine = self._engine
        ready = engine is not None and engine.ready
        self._hooks.end_forward(stream, engine.layout.num_layers if engine is not None and ready else None)
        self._fail_step()  # the layer hooks did not fire (CUDA graph): fail here, before any save
        meta = self._meta()
        if self._step_failed:
            return  # a forward that raised computed nothing valid: none of its chunks are saved
        if meta is None or engine is None or not ready:
            return  # nothing is marked saved: chunks still computed when the server is back are saved then
        self._submit_saves()  # a step without get_finished (never in TensorRT-LLM) still saves
        bpc = engine.layout.blocks_per_chunk
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
            state.handles.append(self._engine.store(keys, block_ids, stream=self._save_stream))

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Report each finished request once, when every store it issued has completed, and each
        parked request once its load is answered."""
        self._submit_saves()
        self._finishing.update(finished_gen_req_ids)
        self._started.update(started_loading_req_ids)
        return take_saved(self._finishing, self._requests), self._loaded()

    def _loaded(self) -> list[int]:
        """Send the parked loads whose promotion is done (an engine that loads in the call: read by
        a later forward), and take the started ones that were answered."""
        engine = self._engine
        if engine is not None:
            for parked in self._parked.values():
                if parked.pending is None and engine.promotion_done(parked.lease):
                    self._send(engine, parked, None)
        ready = []
        for rid in list(self._started):
            parked = self._parked.get(rid)
            if parked is None:  # reported (never parked forever), but its blocks hold nothing
                self._check_load(rid, 0, 1)
            elif parked.pending is None or not parked.pending.done():
                continue
            else:
                self._check_load(rid, parked.pending.result(), parked.want)
                del self._parked[rid]
            self._started.discard(rid)
            ready.append(rid)
        return ready

