"""What the vLLM connector's halves tell each other. Plain, picklable.

    KvDepotVllmMetadata    scheduler -> worker, each step: per-request deltas, preemptions, lease session
    KvDepotHandshake       worker -> scheduler, once (vLLM's handshake metadata): the block views' geometry
    lease_id(request_id)   vLLM's string id as the server's integer lease id, the same in every process

The TensorRT-LLM connector's scheme (``integrations/tensorrt_llm/metadata.py``): requests carry
only *deltas* — chunk keys and block ids the worker has not seen yet — plus this step's load
and how many chunks are computed. Two differences for vLLM: request ids are strings, and a
request that vLLM preempted comes back with a new block list, so its first item after a new
lookup says ``reset`` (the worker drops what it held and starts over). A load vLLM parked
(``load_kv_async``: part of the hit is on disk or in Redis) arrives before vLLM schedules the
request, flagged ``load_async``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvdepot.integrations.deltas import RequestDelta
from kvdepot.layout import PoolLayout

try:  # the messages must be vLLM's types when vLLM is there; the fields are ours either way
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
    )
except ImportError:  # pragma: no cover - vLLM-free imports (docs, layout tests)
    KVConnectorMetadata = object  # type: ignore[assignment,misc]
    KVConnectorHandshakeMetadata = object  # type: ignore[assignment,misc]


@dataclass
class VllmRequestMeta(RequestDelta):
    """One request's instructions for this step (ids are vLLM's strings)."""

    reset: bool = False  # drop the worker's state for this id first (new or resumed request)
    load_async: bool = False  # vLLM parked the request for this load: report it in finished_recving


@dataclass
class KvDepotVllmMetadata(KVConnectorMetadata):
    """The step's metadata: per-request items and requests vLLM preempted this step."""

    requests: list[VllmRequestMeta] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    lease_session: int = 0  # server mode: the scheduler's session, which holds the lookups' leases
    lease_token: bytes = b""  # ... and its token: without it the server refuses the worker's loads


@dataclass
class KvDepotHandshake(KVConnectorHandshakeMetadata):
    """A worker's registration, for the scheduler: the geometry of its block views. In server mode
    the scheduler registers exactly this, so both halves derive the same keys without the
    scheduler rebuilding the geometry from vLLM's specs."""

    layout: PoolLayout
    tp_rank: int = 0
    tp_size: int = 1


def lease_id(request_id: str) -> int:
    """vLLM's string request id as the server's integer request id (63 bits, same in every process)."""
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
