"""Where the vLLM connector's engines live: the one thing in-process and server mode differ in.

    EngineProvider              what a half asks of its mode (the scheduler: why_off .. session;
                                the worker: attach .. stats; both: lease_id, close)
    InProcess(setup)            the process's CacheEngine: attached by the worker, read by the scheduler
    ViaServer(setup)            RemoteEngines on connections of this half's own
    current_engine() / destroy_engine()   the process's in-process engine (tests, benches)

In-process (no ``server_url``): the scheduler reads the engine the worker registered in its own
process, so vLLM's worker must run there (the ``uni`` executor; on CPU
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); anywhere else kvdepot says so once and stays out of the
way. Server (``server_url`` in the extra config, ``KVDEPOT_SERVER_URL`` or the config file): each
half talks to ``kvdepot server`` on a connection of its own, so they may live in different
processes and several vLLM instances share one cache. The worker registers its block views'
geometry and moves blocks as bytes over the socket (the server cannot map vLLM's tensors); the
scheduler registers the same geometry, learnt from the worker's handshake metadata, without
blocks (lookups only). Request ids become 63-bit lease ids (``metadata.lease_id``); the worker
loads under the scheduler's lease. Either way the worker's engine is the process's one
(``integrations/slot.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvdepot.engine import CacheEngine
from kvdepot.engine_api import Engine, PendingStore
from kvdepot.integrations.slot import EngineSlot
from kvdepot.integrations.vllm.metadata import KvDepotHandshake, lease_id
from kvdepot.layout import PoolLayout
from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

if TYPE_CHECKING:
    from kvdepot.integrations.vllm.setup import Setup

logger = logging.getLogger("kvdepot")

IN_PROCESS_BACKENDS = ("uni", "external_launcher")

_slot: EngineSlot[CacheEngine | RemoteEngine] = EngineSlot()  # the worker's engine, in either mode


def tp_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no TP group (tests, single process)
        return 0, 1


class EngineProvider(Protocol):
    """Where a connector half's engine lives. The scheduler half uses ``why_off`` to ``session``,
    the worker half ``attach`` to ``stats``; both ``lease_id`` and ``close``."""

    @property
    def worker_releases(self) -> bool:
        """The worker holds the scheduler's leases (one engine): it releases one it will not load."""
        ...

    def why_off(self) -> str:
        """Why this deployment cannot use kvdepot in this mode (empty: it can)."""
        ...

    def scheduler_engine(self) -> Engine | None:
        """The engine the scheduler looks up in, if ready; never blocks."""
        ...

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """The workers' handshake metadata, keyed by TP rank, reached the scheduler."""
        ...

    def session(self) -> int:
        """The server session the scheduler's leases are taken in (0: in-process)."""
        ...

    def lease_id(self, request_id: str) -> int | str:
        """The lease's request id for vLLM's request id, the same in both halves."""
        ...

    def attach(self, views: Sequence[torch.Tensor], layout: PoolLayout) -> Engine:
        """The worker's registration: the engine that moves these block views."""
        ...

    def handshake(self) -> KvDepotHandshake | None:
        """What the scheduler must learn from this worker (vLLM's handshake metadata)."""
        ...

    def store_chunks(self, store: PendingStore) -> int | None:
        """Chunks a store added, for the stats file; None where only the server knows."""
        ...

    def stats(self) -> dict[str, Any]:
        """The engine's figures for the stats file."""
        ...

    def close(self) -> None:
        """vLLM is closing this half: drop what the provider opened besides the worker's engine
        (which the worker closes first: its copies finish, write-behind drains)."""
        ...


class InProcess:
    """The process's ``CacheEngine``: attached by the worker, read by the scheduler."""

    worker_releases = True

    def __init__(self, setup: Setup) -> None:
        self._setup = setup
        self._engine: CacheEngine | None = None  # the worker half's, once attached

    def why_off(self) -> str:
        parallel = self._setup.vllm_config.parallel_config
        backend = getattr(parallel, "distributed_executor_backend", None)
        if int(getattr(parallel, "world_size", 1) or 1) > 1:
            return f"world_size={parallel.world_size}: in-process mode sees one worker's cache only (use kvdepot server)"
        if backend not in IN_PROCESS_BACKENDS:
            return (f"distributed_executor_backend={backend!r} runs the worker in another process; in-process mode "
                    "needs 'uni' (on CPU: set VLLM_ENABLE_V1_MULTIPROCESSING=0), or use kvdepot server (server_url)")
        return ""

    def scheduler_engine(self) -> Engine | None:
        return current_engine()

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """In-process mode needs none: the scheduler reads the worker's engine."""

    def session(self) -> int:
        return 0

    def lease_id(self, request_id: str) -> int | str:
        return request_id

    def attach(self, views: Sequence[torch.Tensor], layout: PoolLayout) -> Engine:
        rank, size = tp_rank_and_size()

        def keep(old: CacheEngine | RemoteEngine) -> bool:
            if not isinstance(old, CacheEngine):
                return False
            old.register_views(views, layout)
            logger.info("kvdepot: re-registered %d vLLM KV views on the existing engine", len(views))
            return True

        engine, created = _slot.attach(
            lambda: CacheEngine.for_views(views, layout, self._setup.config, tp_rank=rank, tp_size=size), keep)
        assert isinstance(engine, CacheEngine)
        self._engine = engine
        if created:
            logger.info(
                "kvdepot: engine ready (%d layer views of %d blocks x %d B, %s, chunk %d tokens, host %d chunks)",
                len(views), layout.num_blocks, views[0].shape[1], layout.tag, layout.chunk_size, engine.host.num_slots,
            )
        return engine

    def handshake(self) -> KvDepotHandshake | None:
        return None

    def store_chunks(self, store: PendingStore) -> int | None:
        return store.chunks  # known at once in-process

    def stats(self) -> dict[str, Any]:
        return asdict(self._engine.stats()) if self._engine is not None else {}

    def close(self) -> None:
        """Nothing of its own: the engine is the process's, and the worker closes it."""


class ViaServer:
    """``RemoteEngine``s on connections of this half's own: the worker's copies blocks as bytes,
    the scheduler's (registered from the worker's handshake) only looks up."""

    worker_releases = False  # the lease is the scheduler's (another session): its request_finished releases it

    def __init__(self, setup: Setup) -> None:
        assert setup.server_url is not None
        self._setup, self._url = setup, setup.server_url
        self._client: DepotClient | None = None
        self._lookups: RemoteEngine | None = None  # the scheduler's registration, without blocks
        self._worker: RemoteEngine | None = None
        self._tp = (0, 1)
        self._layout: PoolLayout | None = None
        self._warned_unregistered = False

    def _connect(self, role: str) -> DepotClient:
        if self._client is None:
            timeout = float(self._setup.config.server_timeout_s)
            self._client = DepotClient(self._url, timeout_s=timeout, name=f"vllm-{role}")
        return self._client

    def _remote(self, views: Sequence[torch.Tensor] | None, layout: PoolLayout, role: str) -> RemoteEngine:
        config = self._setup.config
        return RemoteEngine.for_views(self._connect(role), views, layout, model_id=config.model_id,
                                      cache_salt=config.cache_salt, tp_rank=self._tp[0], tp_size=self._tp[1],
                                      config=config)

    # ---- the scheduler half ------------------------------------------------------------------
    def why_off(self) -> str:
        parallel = self._setup.vllm_config.parallel_config
        pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        return f"pipeline_parallel_size={pp}: stages hold different layers" if pp > 1 else ""

    def scheduler_engine(self) -> Engine | None:
        remote = self._lookups
        if remote is None and not self._warned_unregistered:
            self._warned_unregistered = True
            logger.warning("kvdepot: no worker has sent its KV cache geometry (vLLM's handshake metadata) yet; "
                           "no lookups until one does")
        return remote if remote is not None and remote.ready else None

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """Register rank 0's geometry (every rank's, with TP: the server checks they agree)."""
        first = metadata.get(0) if metadata else None
        if not isinstance(first, KvDepotHandshake):
            return
        if self._lookups is not None:
            self._lookups.close()
        self._tp = (0, first.tp_size)
        self._lookups = self._remote(None, first.layout, "scheduler")
        logger.info("kvdepot: scheduler looks up in %s (%s, %d layers)", self._url, first.layout.tag,
                    first.layout.num_layers)

    def session(self) -> int:
        return self._client.session_id if self._client is not None else 0

    def lease_id(self, request_id: str) -> int | str:
        return lease_id(request_id)

    # ---- the worker half ----------------------------------------------------------------------
    def attach(self, views: Sequence[torch.Tensor], layout: PoolLayout) -> Engine:
        self._tp, self._layout = tp_rank_and_size(), layout
        self._worker, _ = _slot.attach(lambda: self._remote(views, layout, "worker"), lambda old: False)
        logger.info("kvdepot: worker rank %d/%d copies through %s (%d layer views of %d blocks, %s)",
                    *self._tp, self._url, len(views), layout.num_blocks, layout.tag)
        return self._worker

    def handshake(self) -> KvDepotHandshake | None:
        return KvDepotHandshake(self._layout, *self._tp) if self._layout is not None else None

    def store_chunks(self, store: PendingStore) -> int | None:
        return None  # known when the server replies; the server's stats count them

    def stats(self) -> dict[str, Any]:
        reply = self._worker.stats() if self._worker is not None else None
        return {} if reply is None else {s.group: s.figures for s in reply.shards} | {"sessions": reply.sessions}

    def close(self) -> None:
        """The scheduler's registration and this half's connection (the worker closes its engine)."""
        if self._lookups is not None:
            self._lookups.close()
        if self._client is not None:
            self._client.close()  # END_SESSION: the server drops this session's leases and registrations


def current_engine() -> CacheEngine | None:
    """The process's in-process engine, if a worker registered one."""
    engine = _slot.current()
    return engine if isinstance(engine, CacheEngine) else None


def destroy_engine() -> None:
    """Close and drop the process's worker engine (tests, shutdown)."""
    _slot.destroy()
