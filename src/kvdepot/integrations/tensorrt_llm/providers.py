"""Where the TensorRT-LLM connector's engine lives: the one thing in-process and server mode differ in.

    EngineProvider                  what a half asks: attach (worker), current (scheduler), session, sees_all_ranks
    InProcess(setup)                kvdepot's CacheEngine in this process
    ViaServer(setup)                a RemoteEngine registered with ``kvdepot server``
    current_engine() / current_remote() / destroy_engine()   the process's engine (tests, benches)

TensorRT-LLM builds the worker and the scheduler concurrently. The worker's ``register_kv_caches``
attaches the process's engine (``integrations/slot.py``, one for both modes); the scheduler asks
``provider.current()`` and answers "no hit" until it exists, so neither constructor waits.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol

import torch

from kvdepot.config import DepotConfig
from kvdepot.engine import CacheEngine
from kvdepot.engine_api import Engine
from kvdepot.integrations.slot import EngineSlot
from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

if TYPE_CHECKING:
    from kvdepot.integrations.tensorrt_llm.setup import Setup

logger = logging.getLogger("kvdepot")

_slot: EngineSlot[CacheEngine | RemoteEngine] = EngineSlot()
_clients_lock = threading.Lock()
_clients: dict[str, DepotClient] = {}  # one connection per server for the process: re-registrations keep it


class EngineProvider(Protocol):
    """Where a connector half gets its engine."""

    @property
    def sees_all_ranks(self) -> bool:
        """A hit counts only chunks every TP rank holds (the server checks); False: this rank's only."""
        ...

    def attach(self, pool: torch.Tensor) -> Engine:
        """The worker's ``register_kv_caches``: the process's engine over ``pool`` (created or re-registered)."""
        ...

    def current(self) -> Engine | None:
        """The engine once a worker in this process attached it and it is ready; never blocks."""
        ...

    def session(self) -> int:
        """The server session the scheduler's leases are taken in (0: in-process)."""
        ...


class InProcess:
    """kvdepot's ``CacheEngine`` in this process: this rank's pool only, so no hits under TP."""

    sees_all_ranks = False

    def __init__(self, setup: Setup) -> None:
        self._setup = setup

    def attach(self, pool: torch.Tensor) -> Engine:
        setup = self._setup

        def create() -> CacheEngine:
            engine = CacheEngine.for_pool(pool, setup.tokens_per_block, setup.config, tp_rank=setup.tp_rank,
                                          tp_size=setup.tp_size)
            logger.info("kvdepot: engine ready (pool %s %s, %d B/block, chunk %d tokens, host %d chunks)",
                        tuple(pool.shape), pool.dtype, engine.layout.bytes_per_block, setup.config.chunk_size,
                        engine.host.num_slots)
            return engine

        def keep(old: CacheEngine | RemoteEngine) -> bool:
            if not isinstance(old, CacheEngine):
                return False
            old.register_pool(pool)
            logger.info("kvdepot: re-registered KV pool %s on the existing engine", tuple(pool.shape))
            return True

        return _slot.attach(create, keep)[0]

    def current(self) -> Engine | None:
        return current_engine()

    def session(self) -> int:
        return 0


class ViaServer:
    """A ``RemoteEngine``: every rank registers its shard with ``kvdepot server``, which copies."""

    sees_all_ranks = True

    def __init__(self, setup: Setup) -> None:
        assert setup.server_url is not None
        self._setup, self._url = setup, setup.server_url

    def attach(self, pool: torch.Tensor) -> Engine:
        setup = self._setup

        def create() -> RemoteEngine:
            return RemoteEngine(_client(self._url, setup.config), pool, setup.tokens_per_block,
                                model_id=setup.config.model_id, cache_salt=setup.config.cache_salt,
                                tp_rank=setup.tp_rank, tp_size=setup.tp_size, config=setup.config)

        return _slot.attach(create, lambda old: isinstance(old, RemoteEngine) and old.pool is pool)[0]

    def current(self) -> Engine | None:
        return current_remote()

    def session(self) -> int:
        remote = current_remote()
        return remote.client.session_id if remote is not None else 0


def _client(url: str, config: DepotConfig) -> DepotClient:
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = DepotClient(url, timeout_s=float(config.server_timeout_s), name="tensorrt_llm")
        return client


def current_engine() -> CacheEngine | None:
    """The process's in-process engine, if a worker registered one."""
    engine = _slot.current()
    return engine if isinstance(engine, CacheEngine) else None


def current_remote() -> RemoteEngine | None:
    """The process's server registration, if a worker made one and the server has it."""
    engine = _slot.current()
    return engine if isinstance(engine, RemoteEngine) else None


def destroy_engine() -> None:
    """Close the process's engine and its server connections (tests, shutdown)."""
    _slot.destroy()
    with _clients_lock:
        for client in _clients.values():
            client.close()
        _clients.clear()
