"""The vLLM connector's worker role: the engine over vLLM's layer caches.

    register(kv_caches)       register_kv_caches: per-layer block views -> the provider's engine
    preempted(meta)           handle_preemptions: wait for a preempted request's saves
    start_load(meta)          start_load_kv: apply the step's deltas, run its host loads (synchronous),
                              take its asynchronous loads (disk/Redis hits: ``async_loads.py``)
    save(meta)                wait_for_save: store every chunk computed by now (later prefill chunks
                              too); on CUDA the copy is queued behind the forward pass
    finished(ids) -> (saved, loaded)   get_finished: each delayed request once, after its saves;
                              each asynchronous load once, when answered (its failed blocks to the load errors)
    take_load_errors()        get_block_ids_with_load_errors: blocks a load could not fill
    handshake()               get_handshake_metadata: the views' geometry (server mode)

The engine is the provider's (``providers.py``): the process's ``CacheEngine``, or a ``RemoteEngine``
whose blocks travel over the socket to ``kvdepot server``. Loads name the scheduler's lease (its
server session is in the step's metadata). An engine that is not ready (the server went away
after the scheduler's hit) loads nothing and reports the blocks as load errors: vLLM recomputes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvdepot.engine_api import Engine, Lease, PendingStore
from kvdepot.integrations.saves import take_saved
from kvdepot.integrations.vllm.async_loads import AsyncLoad, AsyncLoads
from kvdepot.integrations.vllm.layout import views_from_kv_caches
from kvdepot.integrations.vllm.metadata import (
    KvDepotHandshake,
    KvDepotVllmMetadata,
    VllmRequestMeta,
)
from kvdepot.integrations.vllm.setup import Setup, logger
from kvdepot.layout import PoolLayout


@dataclass
class WorkerRequest:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks already handed to engine.store
    delayed: bool = False  # the scheduler told us to save: it returns True from request_finished
    handles: list[PendingStore] = field(default_factory=list)


class Worker:
    def __init__(self, setup: Setup) -> None:
        self._setup = setup
        self._provider = setup.provider()
        self._engine: Engine | None = None
        self._lease_session, self._lease_token = 0, b""  # the scheduler's server session and token, from this step's metadata
        self._requests: dict[str, WorkerRequest] = {}
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._async = AsyncLoads()
        self._loaded: set[str] = set()  # answered asynchronous loads, not reported yet

    def register(self, kv_caches: dict[str, Any]) -> None:
        if self._setup.group is None:
            return
        spec, layer_names = self._setup.group
        kv_cache_config = self._setup.kv_cache_config
        names, views = views_from_kv_caches(kv_caches, int(kv_cache_config.num_blocks), layer_names)
        vllm_config = self._setup.vllm_config
        kv_layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                     or getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default")
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        kv_factor = 1 if isinstance(spec, MLAAttentionSpec) else 2
        layout = PoolLayout.from_views(
            views, spec.dtype, int(spec.block_size), self._setup.config.chunk_size, kv_factor=kv_factor,
            tag=f"vllm:{self._backend_name(names[0])}:{kv_layout}",
        )
        self._engine = self._provider.attach(views, layout)
        self._requests.clear()
        self._setup.stats.write("register", layers=len(views), num_blocks=layout.num_blocks, tag=layout.tag,
                                bytes_per_block=layout.bytes_per_block, chunk_size=layout.chunk_size)

    def _backend_name(self, layer_name: str) -> str:
        ctx = getattr(self._setup.vllm_config.compilation_config, "static_forward_context", {}) or {}
        backend = getattr(ctx.get(layer_name), "attn_backend", None)
        try:
            return str(backend.get_name()) if backend is not None else "unknown"
        except Exception:  # pragma: no cover - a backend without a name
            return "unknown"

    def _lease(self, rid: str) -> Lease:
        """The scheduler's lease for the request (taken in its session, named in the metadata)."""
        return Lease(self._provider.lease_id(rid), session=self._lease_session, token=self._lease_token)

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
        engine = self._engine
        if engine is None:
            return
        self._lease_session, self._lease_token = meta.lease_session, meta.lease_token
        for item in meta.requests:
            state = self._requests.get(item.request_id)
            if item.reset or state is None:
                if state is not None:
                    for handle in state.handles:
                        handle.wait()
                state = self._requests[item.request_id] = WorkerRequest()
            state.keys.extend(item.new_keys)
            state.block_ids.extend(item.new_block_ids)
            if item.save_upto_chunks:
                state.delayed = True
            if item.load_num_blocks and item.load_async:
                self._async.add(AsyncLoad(item.request_id, state.keys, state.block_ids, item.load_skip_blocks,
                                          item.load_num_blocks, self._lease(item.request_id)))
            elif item.load_num_blocks:
                self._load(engine, item, state)
        self._advance(engine)

    def _load(self, engine: Engine, item: VllmRequestMeta, state: WorkerRequest) -> None:
        skip, num = item.load_skip_blocks, item.load_num_blocks
        if not engine.ready:  # the server went away after the scheduler's hit: never silent
            self._report_load_error(item, state, 0)
            self._setup.stats.write("load", req=item.request_id, skip_blocks=skip, blocks=0, wanted=num)
            return
        B, bpc = engine.layout.tokens_per_block, engine.layout.blocks_per_chunk
        end = skip + num
        # Keys only as far as the load reaches: vLLM allocates blocks for this step's tokens,
        # not for the whole prompt, and the engine checks keys against the block list.
        chunks = min(-(-end // bpc), len(state.keys), len(state.block_ids) // bpc)
        got_tokens = skip * B
        started = time.perf_counter()
        if chunks * bpc > skip:
            got_tokens = engine.retrieve(
                state.keys[:chunks], state.block_ids[: chunks * bpc], skip_blocks=skip,
                num_blocks=min(num, chunks * bpc - skip), lease=self._lease(item.request_id),
            )
        elif self._provider.worker_releases:
            engine.release(self._lease(item.request_id))
        got = got_tokens // B
        state.saved = max(state.saved, min(got // bpc, len(state.keys)))  # loaded chunks are cached already
        if got < end:  # a lease expired before the load: never silent, vLLM recomputes or fails
            self._report_load_error(item, state, got)
        self._setup.stats.write("load", req=item.request_id, skip_blocks=skip, blocks=max(0, got - skip), wanted=num,
                                ms=round((time.perf_counter() - started) * 1e3, 3))

    def _report_load_error(self, item: VllmRequestMeta, state: WorkerRequest, got: int) -> None:
        end = item.load_skip_blocks + item.load_num_blocks
        missing = state.block_ids[max(got, item.load_skip_blocks) : end]
        self._load_errors.update(missing)
        logger.error("kvdepot: req=%s loaded %d of %d blocks; reporting %d as load errors",
                     item.request_id, max(0, got - item.load_skip_blocks), item.load_num_blocks, len(missing))

    def save(self, meta: KvDepotVllmMetadata) -> None:
        """Copy this step's newly computed chunks out; on CUDA, enqueued behind the forward pass."""
        engine = self._engine
        if engine is None or not engine.ready:
            return  # nothing is marked saved: chunks still computed when the server is back are saved then
        bpc = engine.layout.blocks_per_chunk
        for item in meta.requests:
            state = self._requests.get(item.request_id)
            if state is None or item.save_upto_chunks <= state.saved:
                continue
            first, upto = state.saved, min(item.save_upto_chunks, len(state.keys), len(state.block_ids) // bpc)
            if upto <= first:
                continue
            started = time.perf_counter()
            handle = engine.store(state.keys[first:upto], state.block_ids[first * bpc : upto * bpc])
            state.saved = upto
            state.handles.append(handle)
            self._setup.stats.write("store", req=item.request_id, first_chunk=first, upto_chunk=upto,
                                    new_chunks=self._provider.store_chunks(handle),
                                    ms=round((time.perf_counter() - started) * 1e3, 3))

    def _advance(self, engine: Engine) -> None:
        """Send the asynchronous loads that may go; note those answered for the next get_finished,
        their failed blocks as load errors now (vLLM wants them no later than the pass that reports
        the id)."""
        B = engine.layout.tokens_per_block
        for load, end in self._async.advance(engine):
            self._loaded.add(load.request_id)
            missing = load.errors(end, B)
            state = self._requests.get(load.request_id)
            if state is not None:  # loaded chunks are cached already
                state.saved = max(state.saved, min(end // B // engine.layout.blocks_per_chunk, len(state.keys)))
            if missing:
                self._load_errors.update(missing)
                logger.warning("kvdepot: req=%s async load filled %d of %d blocks; reporting %d as load errors "
                               "(vLLM recomputes them)", load.request_id, load.num - len(missing), load.num, len(missing))
            self._setup.stats.write("load", req=load.request_id, skip_blocks=load.skip, blocks=load.num - len(missing),
                                    wanted=load.num, mode="async")

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Each request whose request_finished returned True, once, when its stores completed; and
        each asynchronous load, once, when it was answered (vLLM's finished_recving)."""
        if self._engine is not None:
            self._advance(self._engine)
        loaded, self._loaded = self._loaded, set()
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
        done = set(take_saved(self._finishing, self._requests))
        if done and self._engine is not None and self._setup.stats.path:
            self._setup.stats.write("finished", req=sorted(done), stats=self._provider.stats())
        return done or None, loaded or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def handshake(self) -> KvDepotHandshake | None:
        """What the scheduler must learn from this worker (vLLM's handshake metadata)."""
        return self._provider.handshake()

    def shutdown(self) -> None:
        """vLLM is closing this worker: finish copies and drain write-behind to disk/Redis."""
        if self._engine is not None:
            for state in self._requests.values():
                for handle in state.handles:
                    handle.wait()
            self._engine.close()
            self._setup.stats.write("shutdown", stats=self._provider.stats())
        self._provider.close()
