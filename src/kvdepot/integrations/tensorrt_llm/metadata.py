"""What the scheduler (rank 0) tells every worker each step. Plain, picklable dataclasses.

TensorRT-LLM broadcasts the scheduler's metadata with ``mpi_broadcast``, so it must pickle and
stay small: requests carry only *deltas* (chunk keys and block ids the workers have not seen yet),
and each worker keeps the rest. Keys, not tokens, travel: the scheduler hashes a request once and
a 128K-token prompt is 512 keys of 16 bytes instead of half a megabyte of token ids. In server
mode the workers load under the scheduler's leases, so the metadata names its server session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.integrations.deltas import RequestDelta


@dataclass
class RequestMeta(RequestDelta):
    """One request's instructions for this step (ids are TensorRT-LLM's integers); every load in
    it is synchronous (the scheduler promises only bytes in host memory)."""


@dataclass
class KvDepotMetadata:
    """The step's metadata: per-request specs plus requests whose worker state can go."""

    requests: list[RequestMeta] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    lease_session: int = 0  # server mode: the scheduler's session, which holds the lookups' leases
    lease_token: bytes = b""  # ... and its token: without it the server refuses other ranks' loads
