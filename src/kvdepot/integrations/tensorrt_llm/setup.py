"""What the TensorRT-LLM connector halves are built from: kvdepot's config read from ``llm_args``,
and the engine provider, which is the one thing in-process and server mode differ in.

    Setup.from_llm_args(llm_args, server=None) -> Setup   config, block size, TP rank/size, mode
    setup.provider() -> EngineProvider                    InProcess (a CacheEngine here) or
                                                          ViaServer (a RemoteEngine on kvdepot server)
    current_engine() / current_remote() / destroy_engine()   the process's engine (tests, benches)

Mode: server when a server URL is configured (``kv_connector_config.server_url`` on TensorRT-LLM
versions that have the field, else ``KVDEPOT_SERVER_URL`` or the config file), in-process
otherwise; ``server=True/False`` pins it (the ``adapter`` and ``mp_adapter`` class names do). In
server mode without a configured URL the per-user default socket is used.

TensorRT-LLM builds the worker and the scheduler concurrently. The worker's ``register_kv_caches``
attaches the process's engine (``integrations/slot.py``, one for both modes); the scheduler asks
``provider.current()`` and answers "no hit" until it exists, so neither constructor waits.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine import CacheEngine
from kvdepot.engine_api import Engine
from kvdepot.integrations.slot import EngineSlot
from kvdepot.server.client import DepotClient
from kvdepot.server.paths import default_url
from kvdepot.server.remote import RemoteEngine

logger = logging.getLogger("kvdepot")

_slot: EngineSlot[CacheEngine | RemoteEngine] = EngineSlot()
_clients_lock = threading.Lock()
_clients: dict[str, DepotClient] = {}  # one connection per server for the process: re-registrations keep it


def _configured_url(llm_args: Any, config: DepotConfig) -> str | None:
    # NOTE: TensorRT-LLM 1.2's KvCacheConnectorConfig has no server_url field (main has): read it if there.
    connector = getattr(llm_args, "kv_connector_config", None)
    return getattr(connector, "server_url", None) or config.server_url or None


def tp_rank_and_size(llm_args: Any) -> tuple[int, int]:
    """This process's TP rank and the TP size; rank from TensorRT-LLM's MPI helper when present."""
    size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    rank = 0
    try:
        from tensorrt_llm._utils import mpi_rank  # type: ignore[import-not-found]

        rank = int(mpi_rank())
    except (ImportError, OSError, RuntimeError):
        rank = 0
    return rank % size, size


def depot_config(llm_args: Any) -> DepotConfig:
    """kvdepot's config for this engine: env/file/defaults, model id from ``llm_args.model``."""
    config = load_config()
    if not config.model_id:
        config = load_config(model_id=str(getattr(llm_args, "model", "") or ""))
    logger.setLevel(config.log_level)
    return config


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


@dataclass(frozen=True)
class Setup:
    """What both halves know from construction on."""

    llm_args: Any  # TorchLlmArgs (read here only)
    config: DepotConfig
    tokens_per_block: int
    tp_rank: int
    tp_size: int
    server_url: str | None  # server mode when set

    @classmethod
    def from_llm_args(cls, llm_args: Any, server: bool | None = None) -> Setup:
        """``server``: None picks the mode by configuration; True/False pins it."""
        config = depot_config(llm_args)
        url = _configured_url(llm_args, config)
        if server is True:
            url = url or default_url()
        elif server is False:
            url = None
        rank, size = tp_rank_and_size(llm_args)
        return cls(llm_args, config, int(llm_args.kv_cache_config.tokens_per_block), rank, size, url)

    def provider(self) -> EngineProvider:
        return ViaServer(self) if self.server_url else InProcess(self)


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
