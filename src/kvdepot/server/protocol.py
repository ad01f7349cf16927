"""The kvdepot server's wire protocol, declared once: operation ids, messages, errors, framing.

A request is a ZMQ multipart message ``[header, body, *payloads]``; a reply is the same shape
(the ROUTER socket adds the peer's identity in front):

    request header  RequestHeader(op, req_id)   msgpack array, never changes
    reply header    ReplyHeader(req_id, status) status 0 = ok, else an ``ErrorCode``
    body            the operation's request/reply Struct, or ``ErrorReply`` when status != 0
    payloads        raw block bytes ("bytes" pools only), separate zero-copy frames

Operations (ids are frozen: never renumbered, never reused; add new ones at the end):

    1 HELLO        version handshake; must come first; opens a session   -> HelloReply
    2 REGISTER     a worker's KV pool (geometry, TP rank, how to reach it) -> capacity granted
    3 LOOKUP       keys or tokens + request id: lease the hit, start its prefetch -> PrefetchStatus
    4 QUERY_PREFETCH_STATUS  request id -> PrefetchStatus (unknown id: UNKNOWN_REQUEST)
    5 STORE        chunk keys + block ids (+ block bytes) -> chunks stored
    6 RETRIEVE     chunk keys + block ids + range -> tokens valid (+ block bytes)
    7 RELEASE      drop a lookup's leases and prefetch state (idempotent)
    8 END_SESSION  release everything the session holds
    9 PING         liveness; the reply names the server instance (a restart changes it)
   10 STATS        live figures of every shard
   11 LAYERS       a load by layer answered early: how many of its layer events are recorded

Chunk keys travel as one ``bytes`` of concatenated 16-byte keys. Hot messages are array-like
msgpack with defaults omitted: new optional fields go last, with defaults. Encoding and frame
handling live in ``wire``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Protocol

import msgspec

from kvdepot.errors import KVDepotError
from kvdepot.server import limits

PROTOCOL_VERSION = 1

Buffer = bytes | bytearray | memoryview
Payloads = Sequence[Buffer]


class Op(IntEnum):
    HELLO = 1
    REGISTER = 2
    LOOKUP = 3
    QUERY_PREFETCH_STATUS = 4
    STORE = 5
    RETRIEVE = 6
    RELEASE = 7
    END_SESSION = 8
    PING = 9
    STATS = 10
    LAYERS = 11


class ErrorCode(IntEnum):
    BAD_MESSAGE = 1  # frames or body do not decode
    UNKNOWN_OP = 2
    VERSION_MISMATCH = 3
    NO_SESSION = 4  # no HELLO from this peer (or the server restarted)
    NOT_REGISTERED = 5  # the operation needs a registered pool
    BAD_REQUEST = 6  # decodes, but a field is out of range
    GEOMETRY_MISMATCH = 7
    UNKNOWN_REQUEST = 8  # no lookup with that request id
    BAD_PAYLOAD = 9
    DEADLINE_EXCEEDED = 10  # the client has given up on this copy already
    UNSUPPORTED = 11
    INTERNAL = 12
    BUSY = 13


class ProtocolError(KVDepotError):
    """A request the server refuses; becomes an ``ErrorReply`` with ``code``."""

    def __init__(self, code: ErrorCode, message: str, req_id: int = 0) -> None:
        super().__init__(message)
        self.code, self.message, self.req_id = code, message, req_id


_HOT = {"frozen": True, "array_like": True, "omit_defaults": True, "gc": False}


class RequestHeader(msgspec.Struct, **_HOT):
    op: int
    req_id: int


class ReplyHeader(msgspec.Struct, **_HOT):
    req_id: int
    status: int = 0


class ErrorReply(msgspec.Struct, frozen=True):
    code: int
    message: str


# ---- session ----------------------------------------------------------------------------------
class Hello(msgspec.Struct, frozen=True):
    """Map-encoded on purpose: every server version can read the version of every client."""

    version: int
    client: str = ""
    pid: int = 0


class HelloReply(msgspec.Struct, frozen=True):
    version: int
    session_id: int
    server_id: int  # random per server start: a new value means the server restarted
    server_pid: int


class CudaIpcPool(msgspec.Struct, frozen=True, tag="cuda"):
    """A pool inside a cudaMalloc allocation, shared by CUDA IPC (the allocation base + offset)."""

    mem_handle: bytes  # cudaIpcMemHandle_t of the allocation base (64 bytes)
    offset: int  # pool start - allocation base
    alloc_bytes: int
    device_uuid: str  # the GPU, independent of CUDA_VISIBLE_DEVICES numbering
    to_server_event: bytes = b""  # cudaIpcEventHandle_t the client records before each copy
    to_client_event: bytes = b""  # ... the server records after each load
    layer_events: tuple[bytes, ...] = ()  # ... one per layer, recorded after that layer of a load by layer
    progress_page: str = ""  # a file the server maps to publish loads' recorded layers (``progress_page``)
    fence: str = ""  # a file the server locks a copy's slot of while it copies (``copy_fence``)
    fence_epoch: int = 0  # the high bits of every ticket of that fence


class ShmPool(msgspec.Struct, frozen=True, tag="shm"):
    """A CPU pool inside a shared file (e.g. on /dev/shm), mapped by the server."""

    path: str
    offset: int = 0
    fence: str = ""  # as CudaIpcPool's
    fence_epoch: int = 0


class BytesPool(msgspec.Struct, frozen=True, tag="bytes"):
    """The server cannot map the pool: block bytes travel as payload frames."""


PoolDesc = CudaIpcPool | ShmPool | BytesPool


class Register(msgspec.Struct, frozen=True):
    model_id: str
    tp_rank: int
    tp_size: int
    tokens_per_block: int
    num_blocks: int
    num_layers: int
    kv_factor: int
    block_elems: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    bytes_per_block: int
    pool: PoolDesc
    cache_salt: str = ""
    # The KV is the same on every TP rank (MLA's latent): the server keeps one copy per chunk and
    # loads it into every rank's pool. Fixed by a model's first REGISTER; workers must agree.
    one_copy: bool = False


class RegisterReply(msgspec.Struct, frozen=True):
    chunk_size: int  # the server's; the client hashes with it
    hash_algo: str
    host_blocks: int  # capacity granted to this rank, in blocks
    disk_blocks: int
    namespace_digest: bytes  # seed of the key chain; the client checks it computed the same
    group: str
    wants_tokens: bool = False  # the server publishes KV events: send a lookup's tokens beside its keys
    progress_page: bool = False  # the server mapped the REGISTER's progress page and writes it
    fence: bool = False  # the server opened the REGISTER's fence: copies may carry tickets


# ---- hot path -----------------------------------------------------------------------------------
class Lookup(msgspec.Struct, **_HOT):
    request_id: int
    keys: bytes = b""
    tokens: list[int] = []
    skip_tokens: int = 0


class QueryPrefetch(msgspec.Struct, **_HOT):
    request_id: int


class PrefetchStatus(msgspec.Struct, **_HOT):
    done: bool  # False: lower tiers are still being staged into host memory
    matched_tokens: int  # end of the hit, in tokens from 0, on every TP rank
    ready_tokens: int  # of which already in host memory
    lease_token: bytes = b""  # LOOKUP: the session's secret; a RETRIEVE naming its leases from another session carries it


class Store(msgspec.Struct, **_HOT):
    keys: bytes
    block_ids: list[int]
    deadline_ns: int = 0  # CLOCK_MONOTONIC; a mapped-pool copy must not start after it
    synced: bool = False  # the client recorded its to_server_event before sending
    ticket: int = 0  # the copy's number in the registration's fence (0: none), ``copy_fence``


class StoreReply(msgspec.Struct, **_HOT):
    stored_chunks: int


class Retrieve(msgspec.Struct, **_HOT):
    keys: bytes
    block_ids: list[int]
    skip_blocks: int = 0
    num_blocks: int | None = None
    lease_session: int = 0  # session that took the lease at LOOKUP (the scheduler's)
    request_id: int | None = None
    deadline_ns: int = 0
    synced: bool = False
    by_layer: bool = False  # copy layer by layer and record the pool's layer events (CUDA IPC pools)
    lease_token: bytes = b""  # lease_session's token (its LOOKUP replies carry it); needed unless it is this session
    early: bool = False  # by_layer: the client asks LAYERS, so the server may reply before every layer is recorded
    ticket: int = 0  # as Store's


class RetrieveReply(msgspec.Struct, **_HOT):
    end_tokens: int  # tokens from 0 valid in the pool afterwards
    loaded_blocks: int
    by_layer: bool = False  # the layer events were recorded (not to_client_event): wait on them per layer
    load_id: int = 0  # by_layer and not 0: only layers 0..layers_ready-1 are recorded yet; ask LAYERS for more
    layers_ready: int = 0


class Layers(msgspec.Struct, **_HOT):
    """Answered once layer ``through`` of load ``load_id`` has its event recorded (or the load
    failed, or the server's wait ran out: then with what is recorded so far)."""

    load_id: int
    through: int


class LayersReply(msgspec.Struct, **_HOT):
    recorded: int  # layers 0..recorded-1 have their events recorded for this load
    failed: str = ""  # not empty: no layer from ``recorded`` on will be; those blocks hold no valid KV
    fenced: bool = False  # failed, and the last layer's event was recorded after every copy that was enqueued


class Release(msgspec.Struct, **_HOT):
    request_id: int


class Empty(msgspec.Struct, **_HOT):
    """A reply without fields (RELEASE, END_SESSION)."""


class EndSession(msgspec.Struct, **_HOT):
    pass


class Ping(msgspec.Struct, **_HOT):
    pass


class GetStats(msgspec.Struct, **_HOT):
    pass


class Pong(msgspec.Struct, **_HOT):
    server_id: int
    time_ns: int


class ShardStats(msgspec.Struct, frozen=True):
    group: str
    rank: int
    figures: dict[str, float]


class StatsReply(msgspec.Struct, frozen=True):
    server_id: int
    pid: int
    url: str
    uptime_s: float
    sessions: int
    mappings: int
    prefetches: int
    shards: list[ShardStats] = []


# ---- the API, declared once ----------------------------------------------------------------------
Reply = tuple[msgspec.Struct, list[Buffer]]


class DepotProtocol(Protocol):
    """What the server implements: one method per operation. ``peer`` is the ZMQ routing id.

    The handler of a TRY_INLINE operation takes ``wait``: with ``wait=False`` (the loop thread)
    it either finishes without waiting on a lock or I/O, or raises ``WouldBlock`` having changed
    nothing. Every failure is raised as ``ProtocolError`` (or an error the service maps to one).
    """

    def hello(self, peer: bytes, msg: Hello, payloads: Payloads) -> Reply: ...
    def register(self, peer: bytes, msg: Register, payloads: Payloads) -> Reply: ...
    def lookup(self, peer: bytes, msg: Lookup, payloads: Payloads, *, wait: bool = True) -> Reply: ...
    def query_prefetch_status(self, peer: bytes, msg: QueryPrefetch, payloads: Payloads) -> Reply: ...
    def store(self, peer: bytes, msg: Store, payloads: Payloads) -> Reply: ...
    def retrieve(self, peer: bytes, msg: Retrieve, payloads: Payloads) -> Reply: ...
    def release(self, peer: bytes, msg: Release, payloads: Payloads, *, wait: bool = True) -> Reply: ...
    def end_session(self, peer: bytes, msg: EndSession, payloads: Payloads) -> Reply: ...
    def ping(self, peer: bytes, msg: Ping, payloads: Payloads) -> Reply: ...
    def stats(self, peer: bytes, msg: GetStats, payloads: Payloads) -> Reply: ...
    def layers(self, peer: bytes, msg: Layers, payloads: Payloads, *, wait: bool = True) -> Reply: ...


class WouldBlock(Exception):  # noqa: N818 - a signal between the loop and a handler, not an error
    """Raised by a TRY_INLINE handler called with ``wait=False`` that would have to wait: the
    loop then hands the request to the pool, which calls the handler again with ``wait=True``."""


class Exec(Enum):
    """Where an operation runs; declared once per op in ``OPS``, read by the server's loop."""

    INLINE = "inline"  # on the loop thread, always: cheap, never waits on a lock or I/O
    TRY_INLINE = "try-inline"  # on the loop thread if the handler (``wait=False``) can finish now, else the pool
    POOL = "pool"  # on the handler pool, always (copies, registration, anything that may wait)


# ---- limits (``limits.py``: what one message may carry) ------------------------------------------
MAX_KEYS, MAX_TOKENS, MAX_BLOCKS, INLINE_KEYS = limits.MAX_KEYS, limits.MAX_TOKENS, limits.MAX_BLOCKS, limits.INLINE_KEYS
_INT, _HDR, _ID, _KEYS, _SMALL = limits.INT, limits.HDR, limits.ID, limits.KEYS, limits.SMALL
_COPY = _HDR + _KEYS + _HDR + MAX_BLOCKS * _ID + 6 * _INT + 4


@dataclass(frozen=True)
class OpSpec:
    """One operation, declared once: its messages, handler, execution mode and size bounds."""

    op: Op
    request: type[msgspec.Struct]
    reply: type[msgspec.Struct]
    handler: str  # the ``DepotProtocol`` method; the server binds it once, at start (``bind``)
    mode: Exec
    max_body: int  # longest legal body frame, in bytes: longer is refused undecoded
    inline_body: int = 0  # longest body decoded on the loop thread (INLINE/TRY_INLINE); longer: the pool
    # (field position, most items, what) of the array-like body's lists and bins, read from their
    # msgpack headers before decoding: 100M one-byte tokens fit the byte bound, not this one
    counts: tuple[tuple[int, int, str], ...] = ()


OPS: dict[int, OpSpec] = {spec.op: spec for spec in (
    OpSpec(Op.HELLO, Hello, HelloReply, "hello", Exec.POOL, 4096),
    OpSpec(Op.REGISTER, Register, RegisterReply, "register", Exec.POOL, 256 << 10),
    OpSpec(Op.LOOKUP, Lookup, PrefetchStatus, "lookup", Exec.TRY_INLINE,
           _HDR + _INT + _KEYS + _HDR + MAX_TOKENS * _ID + _INT, inline_body=_HDR + INLINE_KEYS * 16 + _SMALL,
           counts=((1, MAX_KEYS * 16, "key bytes"), (2, MAX_TOKENS, "tokens"))),
    OpSpec(Op.QUERY_PREFETCH_STATUS, QueryPrefetch, PrefetchStatus, "query_prefetch_status", Exec.INLINE,
           _SMALL, _SMALL),
    OpSpec(Op.STORE, Store, StoreReply, "store", Exec.POOL, _COPY,
           counts=((0, MAX_KEYS * 16, "key bytes"), (1, MAX_BLOCKS, "block ids"))),
    OpSpec(Op.RETRIEVE, Retrieve, RetrieveReply, "retrieve", Exec.POOL, _COPY,
           counts=((0, MAX_KEYS * 16, "key bytes"), (1, MAX_BLOCKS, "block ids"))),
    OpSpec(Op.RELEASE, Release, Empty, "release", Exec.TRY_INLINE, _SMALL, _SMALL),
    OpSpec(Op.END_SESSION, EndSession, Empty, "end_session", Exec.POOL, _SMALL),
    OpSpec(Op.PING, Ping, Pong, "ping", Exec.INLINE, _SMALL, _SMALL),
    OpSpec(Op.STATS, GetStats, StatsReply, "stats", Exec.POOL, _SMALL),
    OpSpec(Op.LAYERS, Layers, LayersReply, "layers", Exec.TRY_INLINE, _SMALL, _SMALL),
)}
OP_OF: dict[type[msgspec.Struct], int] = {spec.request: op for op, spec in OPS.items()}
assert len(OP_OF) == len(OPS), "every operation needs its own request type"

Handler = Callable[[bytes, msgspec.Struct, Payloads], Reply]


@dataclass(frozen=True)
class Bound:
    """An operation's handlers on one implementation: ``run`` (may wait) and, for INLINE and
    TRY_INLINE ops, ``now`` (for the loop thread: never waits, raises ``WouldBlock`` instead)."""

    spec: OpSpec
    run: Handler
    now: Handler | None


def bind(impl: DepotProtocol) -> dict[int, Bound]:
    """Every operation's handlers on ``impl``, looked up once (a missing one fails here, at start)."""
    table: dict[int, Bound] = {}
    for op, spec in OPS.items():
        method = getattr(impl, spec.handler, None)
        if not callable(method):
            raise TypeError(f"{type(impl).__name__} lacks DepotProtocol.{spec.handler} (op {op.name})")
        now = None
        if spec.mode is Exec.INLINE:
            now = method
        elif spec.mode is Exec.TRY_INLINE:
            now = functools.partial(method, wait=False)
        table[op] = Bound(spec, method, now)
    return table

