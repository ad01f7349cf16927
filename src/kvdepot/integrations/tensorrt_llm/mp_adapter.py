"""TensorRT-LLM KV connector, multi-process mode: kvdepot's engine lives in ``kvdepot server``.

    KvCacheConnectorConfig(connector_module="kvdepot.integrations.tensorrt_llm.mp_adapter",
                           connector_scheduler_class="KvDepotMPConnectorScheduler",
                           connector_worker_class="KvDepotMPConnectorWorker")

The server URL comes from ``KVDEPOT_SERVER_URL`` (or ``server_url`` in the config file), else the
per-user default. TensorRT-LLM 1.2's config has only the three fields above and rejects any other;
where a version's config has ``server_url`` (main), ``kv_connector_config.server_url`` wins. The scheduling logic and the metadata are the in-process adapter's (these
classes subclass it); what differs is where the engine is:

Scheduler (rank 0)                                  Worker (every rank)
  LOOKUP + QUERY_PREFETCH_STATUS: in host memory ->   register_kv_caches -> REGISTER its shard (CUDA
  sync; still promoted from disk/Redis -> is_async    IPC / shared file / bytes) with the server
  (loaded via update_state_after_alloc's blocks)      start_load_kv -> RETRIEVE (server copies,
                                                        by layer where in-process would)
  hits count only where every TP rank holds the       wait_for_save -> notes the step's saves
  chunk (the server checks; keys are rank-free)       get_finished -> STORE (after sampling); saves
                                                      replied, async loads in

IPC constraint: the server maps the worker's pool, so server and engine share the machine (and
the GPUs); over TCP to another host only "bytes" pools work. If the server is down, lookups
answer 0 and stores are skipped (one warning per outage); the client re-registers by itself.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from kvdepot.config import DepotConfig
from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
    _WorkerRequest,
)
from kvdepot.integrations.tensorrt_llm.api import SchedulerOutput
from kvdepot.integrations.tensorrt_llm.metadata import KvDepotMetadata, RequestMeta
from kvdepot.integrations.tensorrt_llm.utils import depot_config, tokens_per_block, tp_rank_and_size
from kvdepot.server.client import DepotClient
from kvdepot.server.paths import default_url
from kvdepot.server.remote import RemoteEngine

logger = logging.getLogger("kvdepot")

DEFAULT_TIMEOUT_S = 2.0

_lock = threading.Lock()
_remote: RemoteEngine | None = None
_clients: dict[str, DepotClient] = {}


def server_url(llm_args: Any, config: DepotConfig | None = None) -> str:
    """``kv_connector_config.server_url``, else ``KVDEPOT_SERVER_URL`` (config key server_url), else the default."""
    connector = getattr(llm_args, "kv_connector_config", None)
    url = getattr(connector, "server_url", None) if connector is not None else None
    return url or (config.server_url if config is not None else None) or default_url()


def _client(url: str, config: DepotConfig) -> DepotClient:
    client = _clients.get(url)
    if client is None:
        timeout = float(getattr(config, "server_timeout_s", DEFAULT_TIMEOUT_S))
        client = _clients[url] = DepotClient(url, timeout_s=timeout, name="tensorrt_llm")
    return client


def get_or_create_remote(llm_args: Any, pool: Any) -> RemoteEngine:
    """The process's registration: created by ``register_kv_caches``, replaced with a new pool."""
    global _remote
    with _lock:
        if _remote is not None and _remote.pool is pool:
            return _remote
        if _remote is not None:
            _remote.close()
        config = depot_config(llm_args)
        rank, size = tp_rank_and_size(llm_args)
        client = _client(server_url(llm_args, config), config)
        _remote = RemoteEngine(client, pool, tokens_per_block(llm_args), model_id=config.model_id,
                               cache_salt=config.cache_salt, tp_rank=rank, tp_size=size, config=config)
        return _remote


def current_remote() -> RemoteEngine | None:
    """The registration if the worker has made one and the server has it; never blocks."""
    remote = _remote
    return remote if remote is not None and remote.ready else None


def destroy_remote() -> None:
    """Drop the registration and close the clients (tests, shutdown)."""
    global _remote
    with _lock:
        if _remote is not None:
            _remote.close()
        _remote = None
        for client in _clients.values():
            client.close()
        _clients.clear()


@dataclass
class KvDepotMPMetadata(KvDepotMetadata):
    """The in-process metadata plus the server session that holds the scheduler's leases."""

    lease_session: int = 0


class KvDepotMPConnectorScheduler(KvDepotConnectorScheduler):
    """The in-process scheduler over a ``RemoteEngine``: LOOKUP + QUERY_PREFETCH_STATUS answer
    ``probe``; a hit whose chunks the server is still promoting from disk/Redis is asynchronous."""

    def _resolve(self) -> Any:
        self._engine = current_remote()  # type: ignore[assignment]  # None until registered and reachable
        return self._engine

    def _refuse_tp(self) -> bool:
        return False  # every rank registers its shard; the server counts a hit only on all ranks

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvDepotMPMetadata:
        base = super().build_connector_meta(scheduler_output)
        engine: RemoteEngine | None = self._engine  # type: ignore[assignment]
        session = engine.client.session_id if engine is not None else 0
        return KvDepotMPMetadata(requests=base.requests, finished=base.finished, lease_session=session)


class KvDepotMPConnectorWorker(KvDepotConnectorWorker):
    """The in-process worker over a ``RemoteEngine``: the server does the copies.

    Synchronous loads wait for the RETRIEVE reply in ``start_load_kv`` (the host waits for the
    round trip; on CUDA the forward stream waits for the copy on the device). Asynchronous loads
    are sent at once without waiting; the server holds each until its promotion is done, and
    ``get_finished`` reports the request once the reply is in.
    """

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._issued: dict[int, tuple[Any, int]] = {}  # async loads sent: handle, tokens expected
        self._load_started: set[int] = set()

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self._engine = get_or_create_remote(self._llm_args, kv_cache_tensor)  # type: ignore[assignment]
        self._requests.clear()

    def _send_load(self, item: RequestMeta, state: _WorkerRequest, stream: Any, *,
                   by_layer: bool = False) -> tuple[Any, int]:
        engine: RemoteEngine = self._engine  # type: ignore[assignment]
        lease = (getattr(self._metadata, "lease_session", 0), item.request_id)
        handle = engine.retrieve_async(
            None, state.block_ids, keys=state.keys, skip_blocks=item.load_skip_blocks,
            num_blocks=item.load_num_blocks, lease=lease, stream=stream, by_layer=by_layer,
        )
        return handle, (item.load_skip_blocks + item.load_num_blocks) * engine.tokens_per_block

    def _load(self, item: RequestMeta, state: _WorkerRequest, stream: Any, *, by_layer: bool = True) -> None:
        """A load by the server, by layer where the in-process worker would load by layer and the
        server can (it copies every layer before it answers, recording each layer's interprocess
        event; the forward then waits for each layer in ``wait_for_layer_load``)."""
        handle, want = self._send_load(item, state, stream, by_layer=by_layer and self._may_load_by_layer())
        _check_load(item.request_id, handle.result(), want)
        if handle.layered is not None:
            self._layered.append(handle.layered)

    def start_load_kv(self, stream: Any) -> None:
        super().start_load_kv(stream)  # synchronous loads run; asynchronous ones are parked
        for rid, item in list(self._async_loads.items()):
            del self._async_loads[rid]
            self._issued[rid] = self._send_load(item, self._requests[rid], stream)

    def wait_for_save(self, stream: Any) -> None:
        engine: RemoteEngine | None = self._engine  # type: ignore[assignment]
        if engine is None or not engine.ready:
            return  # nothing is marked saved: chunks still computed when the server is back are saved then
        super().wait_for_save(stream)

    def _progress_async_loads(self, started: list[int]) -> list[int]:
        """Requests handed over as loading whose RETRIEVE has been answered (or has failed)."""
        self._load_started.update(started)
        ready = []
        for rid in list(self._load_started):
            entry = self._issued.get(rid)
            if entry is not None and not entry[0].done():
                continue
            if entry is None:
                logger.warning("kvdepot: req=%s was loading asynchronously but no load reached this worker", rid)
            else:
                _check_load(rid, entry[0].result(), entry[1])
            self._issued.pop(rid, None)
            self._load_started.discard(rid)
            ready.append(rid)
        return ready


def _check_load(rid: int, got: int, want: int) -> None:
    if got < want:  # the server died or evicted past the lease: never silent
        logger.error("kvdepot: req=%s loaded %d of %d promised tokens from the server; the rest of its "
                     "prefix is not valid KV", rid, got, want)
