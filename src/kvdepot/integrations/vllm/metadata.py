"""What the scheduler-side connector tells the worker-side one each step. Plain, picklable.

The TensorRT-LLM adapter's scheme (``integrations/tensorrt_llm/metadata.py``): requests carry
only *deltas* — chunk keys and block ids the worker has not seen yet — plus this step's load
and how many chunks are computed. Two differences for vLLM: request ids are strings, and a
request that vLLM preempted comes back with a new block list, so its first item after a new
lookup says ``reset`` (the worker drops what it held and starts over).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.integrations.deltas import RequestDelta

try:  # the metadata must be vLLM's type when vLLM is there; the fields are ours either way
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # pragma: no cover - vLLM-free imports (docs, layout tests)
    KVConnectorMetadata = object  # type: ignore[assignment,misc]


@dataclass
class VllmRequestMeta(RequestDelta):
    """One request's instructions for this step (ids are vLLM's strings)."""

    reset: bool = False  # drop the worker's state for this id first (new or resumed request)


@dataclass
class KvDepotVllmMetadata(KVConnectorMetadata):
    """The step's metadata: per-request items and requests vLLM preempted this step."""

    requests: list[VllmRequestMeta] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    lease_session: int = 0  # server mode: the scheduler's session, which holds the lookups' leases
    lease_token: bytes = b""  # ... and its token: without it the server refuses the worker's loads
