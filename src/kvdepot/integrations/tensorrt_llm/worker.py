"""The TensorRT-LLM connector's worker half (every rank): moves whole blocks between the pool and kvdepot.

    register_kv_caches -> provider.attach(pool): the process's engine over this rank's pool
    start_load_kv      -> the step's deltas; synchronous loads (by layer where allowed)
    wait_for_layer_load-> the forward stream waits for layer i of this forward's layered loads
    wait_for_save      -> notes the step's saves (enqueued at get_finished, after sampling)
    get_finished       -> saves enqueued; requests whose saves completed (no load is ever parked)

The engine is the provider's (``providers.py``): a ``CacheEngine`` copies here on its side streams,
a ``RemoteEngine`` has ``kvdepot server`` copy (CUDA IPC, a shared file, or bytes over the socket).
Both answer the same calls (``engine_api.Engine``); what the worker branches on is declared in
``engine.capabilities``.

Loads by layer (``load_by_layer: auto``, where the engine can): the load is copied layer by layer
(in-process a few layers ahead of the hooks, ``transfer/layered.py``; in server mode by the server,
which answers once layer 0 is in) and ``wait_for_layer_load(i)`` makes the forward stream wait only for layer
``i``, so a hit's copies overlap the forward over the new tokens. Only once a whole forward's
layer hooks were seen to fire, and never again after one was missed (``layer_hooks.py``).

Every load is synchronous: the scheduler promises only bytes pinned in host memory (scheduler.py).
A promise can still come up short in one way: in server mode, the server gone (or the lease lost)
between the lookup and the load. TensorRT-LLM 1.2 has no safe ending for that: the request would
compute from blocks that do not hold its KV, and an error raised in the forward makes the executor
store the failed requests' blocks in its prefix tree for device reuse (docs/tensorrt-llm.md). So
a short load is a *fail-stop*: the worker counts it (``stats.failed_promises``), logs it, and
raises ``PromisedLoadFailed`` from ``start_load_kv`` — outside the forward, where 1.2's loop stops
without failing (and so storing) any request — and from every later call outside the forward.
A layered load that fails mid-forward (server mode: a layer the server could not copy) raises
``TransferFailed`` from that layer's hook, which the forward cannot avoid, and the worker ends
the loop at the next ``get_finished``, before another step can reuse what that error stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvdepot.engine_api import Engine, Lease, PendingStore
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
class WorkerStats:
    """What this rank's worker counted (the engine's own counters are in ``engine.stats()``)."""

    failed_promises: int = 0  # promised loads that came up short: the executor loop was stopped


class KvDepotWorker(KvCacheConnectorWorker):
    """Moves whole blocks between TensorRT-LLM's pool and kvdepot, off the forward stream."""

    server: ClassVar[bool | None] = None  # None: the mode by configuration; True/False pins it

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._provider = Setup.from_llm_args(llm_args, server=self.server).provider()
        self._engine: Engine | None = None
        self._requests: dict[int, _WorkerRequest] = {}
        self._finishing: set[int] = set()
        self._pending_saves: list[tuple[_WorkerRequest, list[int], list[bytes]]] = []  # noted, not enqueued
        self._save_stream: Any = None
        self._hooks = LayerHooks()
        self.stats = WorkerStats()
        self._stopped: str | None = None  # why this engine's loop must end (a promise came up short)
        self._step_failed = False  # this step's forward raised: none of its saves are noted

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self._engine = self._provider.attach(kv_cache_tensor)
        self._requests.clear()

    def _meta(self) -> KvDepotMetadata | None:
        meta = self._metadata  # None on ranks where the broadcast gave nothing (tolerated)
        return meta if isinstance(meta, KvDepotMetadata) else None

    def start_load_kv(self, stream: Any) -> None:
        meta, engine = self._meta(), self._engine
        self._fail_stop()
        if meta is None or engine is None:
            return
        self._submit_saves()
        self._hooks.settle(stream)  # a forward that never came (never in TensorRT-LLM)
        self._step_failed = False
        for rid in meta.finished:
            self._requests.pop(rid, None)
        for item in meta.requests:
            state = self._requests.setdefault(item.request_id, _WorkerRequest())
            state.keys.extend(item.new_keys)
            state.block_ids.extend(item.new_block_ids)
            if item.load_num_blocks:
                lease = Lease(item.request_id, session=meta.lease_session, token=meta.lease_token)
                self._load(engine, item, state, lease, stream)
        self._fail_stop()

    def _load(self, engine: Engine, item: RequestMeta, state: _WorkerRequest, lease: Lease, stream: Any) -> None:
        args: dict[str, Any] = dict(skip_blocks=item.load_skip_blocks, num_blocks=item.load_num_blocks,
                                    lease=lease, stream=stream)
        if self._may_load_by_layer(engine):
            got, layered = engine.retrieve_by_layer(state.keys, state.block_ids, **args)
            if layered is not None:
                self._hooks.add(layered)
        else:
            got = engine.retrieve(state.keys, state.block_ids, **args)
        want = self._want(engine, item)
        if got < want:  # the server went away, or the lease was lost, after the lookup
            self.stats.failed_promises += 1
            self._stop(f"req={item.request_id} loaded {got} of {want} promised tokens")

    def _stop(self, why: str) -> None:
        if self._stopped is None:
            self._stopped = why
            logger.critical("kvdepot: %s; TensorRT-LLM 1.2 cannot take a promised load back, and any request that "
                            "ends with an error has its blocks stored for device reuse, so this engine's loop is "
                            "stopped (restart the engine)", why)

    def _fail_stop(self) -> None:
        """Raise, outside the forward, once a promise came up short: 1.2's loop then ends without
        terminating (and so storing) any request."""
        if self._stopped is not None:
            raise PromisedLoadFailed(f"kvdepot: {self._stopped}: the engine's loop is stopped instead of computing "
                                     "from, or storing, blocks that do not hold their KV")

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
        copies could not be enqueued: its blocks hold no valid KV, and the forward must not go on;
        the loop is then stopped at the next ``get_finished`` (module docstring)."""
        try:
            self._hooks.wait_layer(layer_idx, stream)
        except Exception as exc:
            self._step_failed = True
            self.stats.failed_promises += 1
            self._stop(f"a layered load failed in layer {layer_idx} ({exc})")
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
        """Report each finished request once, when every store it issued has completed (no load is
        ever parked: ``started_loading_req_ids`` stays empty)."""
        self._fail_stop()
        self._submit_saves()
        self._finishing.update(finished_gen_req_ids)
        return take_saved(self._finishing, self._requests), []
