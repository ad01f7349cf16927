"""The connector against ``kvdepot server``: scheduler and worker need not share a process.

    KVTransferConfig(kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"server_url": "ipc:///…/server.sock"})

Chosen when ``server_url`` is set (extra config, ``KVDEPOT_SERVER_URL`` or the config file). The
roles are the in-process ones (``scheduler.Scheduler``, ``worker.Worker``) over a
``server.remote.RemoteEngine`` each, on a connection of their own:

Worker (vLLM's worker process)                       Scheduler (vLLM's engine-core process)
  register_kv_caches -> per-layer block views,         set_xfer_handshake_metadata -> REGISTER the
    REGISTER their geometry (blocks travel over the      worker's geometry, no blocks (lookups only)
    socket: the server cannot map vLLM's tensors)      get_num_new_matched_tokens -> LOOKUP, leased
  get_handshake_metadata -> that geometry                under this session and the request's id
  start_load_kv -> RETRIEVE naming the scheduler's     request_finished -> RELEASE
    lease (session id + token in the step's metadata)
  wait_for_save -> STORE; get_finished after replies

The geometry reaches the scheduler through vLLM's handshake metadata, collected from every
worker after ``register_kv_caches``, so the scheduler never rebuilds it from specs and both
register exactly the same thing. Request ids become 63-bit lease ids by a fixed digest, the same
in both processes. If the server is down, lookups answer 0, saves are skipped, a promised load
that fails is reported through ``get_block_ids_with_load_errors`` (vLLM recomputes), and the
client re-registers by itself when the server is back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from kvdepot.integrations.vllm.common import Setup, logger
from kvdepot.integrations.vllm.metadata import KvDepotVllmMetadata, VllmRequestMeta
from kvdepot.integrations.vllm.scheduler import Scheduler
from kvdepot.integrations.vllm.worker import Worker, WorkerRequest, tp_rank_and_size
from kvdepot.layout import PoolLayout
from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

try:  # the handshake must be vLLM's type when vLLM is there; the fields are ours either way
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
except ImportError:  # pragma: no cover - vLLM-free imports
    KVConnectorHandshakeMetadata = object  # type: ignore[assignment,misc]


def lease_id(request_id: str) -> int:
    """vLLM's string request id as the server's integer request id (63 bits, same in every process)."""
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class KvDepotHandshake(KVConnectorHandshakeMetadata):
    """A worker's registration, for the scheduler: the geometry of its block views."""

    layout: PoolLayout
    tp_rank: int = 0
    tp_size: int = 1


def _client(setup: Setup, role: str) -> DepotClient:
    url = setup.server_url
    assert url is not None
    return DepotClient(url, timeout_s=float(setup.config.server_timeout_s), name=f"vllm-{role}")


def _remote(setup: Setup, client: DepotClient, views: list[Any] | None, layout: PoolLayout,
            tp_rank: int, tp_size: int) -> RemoteEngine:
    config = setup.config
    return RemoteEngine.for_views(client, views, layout, model_id=config.model_id, cache_salt=config.cache_salt,
                                  tp_rank=tp_rank, tp_size=tp_size, config=config)


class RemoteScheduler(Scheduler):
    """Lookups by LOOKUP on a registration of the workers' geometry (no blocks behind it)."""

    def __init__(self, setup: Setup) -> None:
        self._client: DepotClient | None = None
        self._remote: RemoteEngine | None = None
        self._warned_unregistered = False
        super().__init__(setup)
        if not self._disabled_reason:
            self._client = _client(setup, "scheduler")

    def _why_off(self) -> str:
        parallel = self._setup.vllm_config.parallel_config
        pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        return f"pipeline_parallel_size={pp}: stages hold different layers" if pp > 1 else ""

    def _engine(self) -> RemoteEngine | None:
        remote = self._remote
        if remote is None and self._client is not None and not self._warned_unregistered:
            self._warned_unregistered = True
            logger.warning("kvdepot: no worker has sent its KV cache geometry (vLLM's handshake metadata) yet; "
                           "no lookups until one does")
        return remote if remote is not None and remote.ready else None

    def _lease(self, rid: str) -> Hashable:
        return lease_id(rid)

    def _hash_algo(self, engine: RemoteEngine) -> str:
        assert engine.granted is not None
        return engine.granted.hash_algo

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """Register rank 0's geometry (every rank's, with TP: the server checks they agree)."""
        first = metadata.get(0) if metadata else None
        if self._client is None or not isinstance(first, KvDepotHandshake):
            return
        if self._remote is not None:
            self._remote.close()
        self._remote = _remote(self._setup, self._client, None, first.layout, 0, first.tp_size)
        logger.info("kvdepot: scheduler looks up in %s (%s, %d layers)", self._client.url, first.layout.tag,
                    first.layout.num_layers)

    def build_meta(self, scheduler_output: Any) -> KvDepotVllmMetadata:
        meta = super().build_meta(scheduler_output)
        meta.lease_session = self._client.session_id if self._client is not None else 0
        meta.lease_token = self._remote.lease_token if self._remote is not None else b""
        return meta

    def shutdown(self) -> None:
        if self._remote is not None:
            self._remote.close()
        if self._client is not None:
            self._client.close()  # END_SESSION: the server drops this session's leases


class RemoteWorker(Worker):
    """Copies through the server; blocks travel as bytes (vLLM's tensors are not in a shared file)."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self._client: DepotClient | None = None
        self._lease_session, self._lease_token = 0, b""
        self._tp = (0, 1)

    def _attach(self, views: list[Any], layout: PoolLayout) -> RemoteEngine:
        if self._engine is not None:
            self._engine.close()
        if self._client is None:
            self._client = _client(self._setup, "worker")
        self._tp = tp_rank_and_size()
        remote = _remote(self._setup, self._client, views, layout, *self._tp)
        logger.info("kvdepot: worker rank %d/%d copies through %s (%d layer views of %d blocks, %s)",
                    *self._tp, self._client.url, len(views), layout.num_blocks, layout.tag)
        return remote

    def handshake(self) -> KvDepotHandshake | None:
        return KvDepotHandshake(self._layout, *self._tp) if self._layout is not None else None

    def _lease(self, rid: str) -> Hashable:
        return (self._lease_session, lease_id(rid), self._lease_token)

    def _release(self, rid: str) -> None:
        """The lease is the scheduler's (another session): its request_finished releases it."""

    def _new_chunks(self, handle: Any) -> int | None:
        return None  # known when the server replies; the server's stats count them

    def _stats(self) -> dict[str, Any]:
        reply = self._engine.stats() if self._engine is not None else None
        return {} if reply is None else {s.group: s.figures for s in reply.shards} | {"sessions": reply.sessions}

    def start_load(self, meta: KvDepotVllmMetadata) -> None:
        self._lease_session, self._lease_token = meta.lease_session, meta.lease_token
        super().start_load(meta)

    def _load(self, item: VllmRequestMeta, state: WorkerRequest) -> None:
        if not self._engine.ready:  # the server went away after the scheduler's hit: never silent
            self._report_load_error(item, state, 0)
            self._setup.stats.write("load", req=item.request_id, skip_blocks=item.load_skip_blocks, blocks=0,
                                    wanted=item.load_num_blocks)
            return
        super()._load(item, state)

    def save(self, meta: KvDepotVllmMetadata) -> None:
        if self._engine is None or not self._engine.ready:
            return  # nothing is marked saved: chunks still computed when the server is back are saved then
        super().save(meta)

    def shutdown(self) -> None:
        if self._engine is not None:
            for state in self._requests.values():
                for handle in state.handles:
                    handle.wait()
            self._setup.stats.write("shutdown", stats=self._stats())
            self._engine.close()
        if self._client is not None:
            self._client.close()  # END_SESSION: the server unregisters this worker's views

