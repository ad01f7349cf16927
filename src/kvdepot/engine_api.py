"""The seam between connectors and the cache: the ``Engine`` protocol, its lease and handles.

Two engines satisfy it: ``CacheEngine`` (``engine.py``, the tiers in this process) and
``RemoteEngine`` (``server/remote.py``, the tiers in ``kvdepot server``). A connector is written
against ``Engine`` alone; which one it holds is configuration. Every call takes chunk *keys*:
tokens are turned into keys once, at the edge (``chunk_keys``, or the engine's ``hasher`` for a
request whose prompt grows).

Primitives (``B`` = tokens per block, ``C`` = tokens per chunk; block ``i`` of a request's block
list holds its tokens ``[i*B, (i+1)*B)``):

    probe(keys, skip_tokens=0, lease=None) -> Hit
        pre:  ``skip_tokens >= 0``; ``keys`` are the request's chained keys from chunk 0.
        post: ``Hit.tokens`` is the end (tokens from 0) of the run of cached chunks that starts at
              ``skip_tokens // C``'s chunk; ``Hit.host_tokens <= Hit.tokens`` the end of the part
              in host memory now (the rest is being promoted from disk/Redis: ``Hit.pending``).
              With a lease, what was counted stays pinned until ``release(lease)``, a later probe
              under the same lease (which replaces its pins), the load that names it, or the lease
              timeout; without one nothing is pinned or promoted.
    lookup(...) -> int                                  ``probe(...).tokens``
    release(lease)
        post: the lease pins nothing; idempotent, and harmless for a lease never taken.
    promotion_done(lease) -> bool
        post: True once the lower-tier part of the lease's hit is in host memory (or failed, or
              never was, or the engine cannot tell: a remote lease of another session): a load
              may then run without waiting for disk or Redis.
    store(keys, block_ids, stream=None) -> PendingStore
        pre:  ``block_ids`` distinct, in range, at least ``len(keys) * C / B`` of them
              (``CacheEngine`` raises ``LayoutError`` otherwise; ``RemoteEngine`` stores the
              chunks the blocks hold).
        post: every full chunk of ``keys`` not cached yet is copied out of ``pool[block_ids]``;
              the blocks may be reused once the handle is ``done()``. Stored chunks become
              visible to probes once their copy completed. Never raises for a full tier (it
              evicts, or drops the store and counts it).
    retrieve(keys, block_ids, skip_blocks=0, num_blocks=None, lease=None, stream=None) -> int
        pre:  as for store; ``skip_blocks, num_blocks >= 0``.
        post: writes only blocks ``[skip_blocks, skip_blocks + num_blocks)`` (never the blocks the
              engine already holds), stops at the first chunk not cached, and answers the end
              (tokens from 0) of what is then valid: ``skip_blocks * B`` when nothing was loaded.
              ``stream`` (default: the current one) is made to wait for the whole load. The lease
              is released: its pins do not outlive the load.
    retrieve_by_layer(...) -> (int, LayerWaits | None)
        post: as ``retrieve``; where the answer carries a ``LayerWaits`` the stream was *not*
              made to wait, and the caller must wait on it layer by layer before each layer reads
              its blocks (and wholly before anything else does). ``None``: loaded whole.
    retrieve_async(..., by_layer=False) -> PendingLoad
        post: ``result()`` is ``retrieve``'s answer; until ``done()`` the blocks are not valid.
              By layer where asked and granted (``PendingLoad.layered``), as above.
    close()
        post: the engine's copies have finished and its threads are joined; a shared client
              (``RemoteEngine``) stays open.

Capabilities are declared, never probed (``Capabilities``): ``layered_loads`` says whether
``retrieve_by_layer`` can ever answer a ``LayerWaits`` here, ``async_loads`` whether
``retrieve_async`` returns before the load has been enqueued (else it completes in the call).

Failures: bad input raises ``LayoutError`` (one line naming the value). A bad block id is found
before anything is copied to or from a block outside the pool, a block listed twice, or a block
a load skips; on a GPU, a list longer than a few MiB of blocks may have had its first blocks (its
lead) copied by then: a load's own chunks into blocks it was given to fill, a store's into slots
it then frees (``engine_loads.LoadPath._check_lead``). A load that raises has released its
lease, wherever it failed (its pins never wait for the lease's timeout). An unavailable server never
raises (a probe answers ``Hit(0, 0)``, a store is skipped, a load answers ``skip_blocks * B``),
so a connector recomputes. This module imports nothing heavy (no torch): connectors and tools can
type against it cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: keeps this module free of torch
    from kvdepot.config import DepotConfig
    from kvdepot.keys import ChunkHasher, ChunkKey
    from kvdepot.layout import PoolLayout
    from kvdepot.transfer.layered import LayerWaits

__all__ = ["Capabilities", "Engine", "Hit", "Lease", "PendingLoad", "PendingStore"]


@dataclass(frozen=True)
class Lease:
    """Names the pins a probe takes, so the load that follows (or ``release``) finds them.

    ``request_id`` is the engine's request id (an int on the wire: 63 bits at most);
    ``session`` is the server session that took the lease (0: the caller's own, or in-process).
    ``token`` is opaque proof of ownership, empty in-process: a server may hand one out with a
    lease so that whoever holds it (the worker of the scheduler that probed) may load or release
    under it. It is not part of the lease's identity.
    """

    request_id: int | str
    session: int = 0
    token: bytes = field(default=b"", compare=False, repr=False)


@dataclass(frozen=True)
class Hit:
    """A probe's answer: where the cached run ends, and how much of it is in host memory now."""

    tokens: int  # end of the cached run, in tokens from position 0 (host and lower tiers)
    host_tokens: int  # end of the part already in host memory
    # how fast the lower tiers have been read into host memory, in tokens per second (finished
    # promotions, measured by the engine); None when not measured yet, or not reported (server mode)
    read_tokens_per_s: float | None = None

    @property
    def pending(self) -> bool:
        """Part of the hit is being promoted from disk/Redis: load it asynchronously."""
        return self.tokens > self.host_tokens


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by the engine (connectors branch on these, never on hasattr)."""

    layered_loads: bool  # retrieve_by_layer may answer a LayerWaits (else it always loads whole)
    async_loads: bool  # retrieve_async returns before the load is enqueued (else it completes in the call)


class PendingStore(Protocol):
    """A store in flight: the blocks it reads may be reused once ``done()``."""

    @property
    def chunks(self) -> int:
        """Chunks this store copies (0 while a remote store is unanswered, or if none)."""
        ...

    def done(self) -> bool:
        """Non-blocking: every copy of the store has completed (or failed and been dropped)."""
        ...

    def wait(self) -> None:
        """Block until ``done()``."""
        ...


class PendingLoad(Protocol):
    """A load in flight; ``layered`` is set once done where it was granted by layer."""

    layered: LayerWaits | None

    def done(self) -> bool:
        """Non-blocking: the load has been answered (its copies enqueued, or it failed)."""
        ...

    def result(self) -> int:
        """Block until done; the end (tokens from 0) of what is then valid."""
        ...


class Engine(Protocol):
    """What a connector holds: lookups, copies and leases over one KV pool (see the module docstring)."""

    config: DepotConfig

    @property
    def ready(self) -> bool:
        """Whether calls reach the tiers (a remote engine: registered with a live server)."""
        ...

    @property
    def layout(self) -> PoolLayout:
        """The pool's geometry with the chunk size in force (raises before a remote one registered)."""
        ...

    @property
    def hasher(self) -> ChunkHasher:
        """Tokens -> this engine's chunk keys (raises before a remote one registered)."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    def chunk_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        """The chained keys of every full chunk of ``tokens`` (the edge helper); their tokens are
        described to the KV events (docs/events.md)."""
        ...

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int]) -> None:
        """Tell the KV events that ``keys[i]`` holds ``tokens[i*C:(i+1)*C]``, for callers that key
        chunks with a hasher of their own; only a described chunk is announced."""
        ...

    def probe(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: Lease | None = None) -> Hit: ...

    def lookup(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: Lease | None = None) -> int: ...

    def release(self, lease: Lease) -> None: ...

    def promotion_done(self, lease: Lease) -> bool: ...

    def store(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, stream: Any = None) -> PendingStore: ...

    def retrieve(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
        num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None,
    ) -> int: ...

    def retrieve_by_layer(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
        num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None,
    ) -> tuple[int, LayerWaits | None]: ...

    def retrieve_async(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
        num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None, by_layer: bool = False,
    ) -> PendingLoad: ...

    def close(self) -> None: ...
