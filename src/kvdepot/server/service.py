"""The server's handlers (``protocol.DepotProtocol``): sessions, model groups, copies.

Transport-free: ``handle(peer, frames)`` takes a request's frames and returns the reply's, so
the ZMQ loop (``server.py``) and tests drive the same code. Every failure becomes an error
reply with a code and a message; nothing a client sends can take the service down.

``try_inline`` answers on the caller's (the loop's) thread what cannot block: the operations the
protocol declares inline (PING, QUERY_PREFETCH_STATUS), and LOOKUP (by keys, at most
``INLINE_KEYS``) and RELEASE when every engine involved has no lower tier (disk/Redis lookups
may wait on I/O) and its lock is free right now; anything else is left for the pool (None).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import msgspec
import torch

from kvdepot.config import DepotConfig
from kvdepot.errors import ConfigError, LayoutError
from kvdepot.events.publisher import publisher_from_config
from kvdepot.keys import KEY_BYTES
from kvdepot.layout import PoolLayout
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.ipc import (
    MAX_LAYER_EVENTS,
    IpcError,
    device_by_uuid,
    frame_tensor,
    open_pool,
    torch_dtype,
)
from kvdepot.server.protocol import ErrorCode, ProtocolError
from kvdepot.server.session import Registration, Session
from kvdepot.server.shard import Group
from kvdepot.transfer.layered import LayerWaits

logger = logging.getLogger("kvdepot")

MAX_CHUNKS = 1 << 20  # keys in one message (a 256M-token prompt at chunk 256)
INLINE_KEYS = 2048  # a longer LOOKUP runs on the pool: the loop thread serves everyone
MAX_BLOCKS = 1 << 22
_LIMITS = {"tp_size": 4096, "num_blocks": 1 << 31, "num_layers": 4096, "block_elems": 1 << 31,
           "tokens_per_block": 1 << 20, "bytes_per_block": 1 << 36}


class DepotService:
    """Implements every operation of ``protocol.DepotProtocol``."""

    def __init__(self, config: DepotConfig, *, url: str = "", session_timeout_s: float = 30.0,
                 max_payload_bytes: int = 4 << 30) -> None:
        self.config, self.url = config, url
        self.allow_shm = url.startswith("ipc://") or not url
        self.session_timeout_s, self.max_payload_bytes = session_timeout_s, max_payload_bytes
        self.server_id = secrets.randbits(63)
        self.started = time.monotonic()
        self._lock = threading.Lock()  # the tables below; held only for dict operations
        self._sessions: dict[bytes, Session] = {}
        self._groups: dict[tuple[str, str], Group] = {}
        self._sids = itertools.count(1)
        self.events = publisher_from_config(config)  # one KV-event publisher for every engine here

    # ---- dispatch -----------------------------------------------------------------------------
    def handle(self, peer: bytes, frames: Sequence[p.Buffer]) -> list[p.Buffer]:
        """Reply frames for one request's frames; never raises."""
        try:
            header, spec, msg, payloads = w.parse_request(frames)
        except ProtocolError as exc:
            return w.error_frames(exc.req_id, exc.code, exc.message)
        return self.dispatch(peer, header.req_id, spec, msg, payloads)

    def dispatch(self, peer: bytes, req_id: int, spec: p.OpSpec, msg: msgspec.Struct,
                 payloads: p.Payloads) -> list[p.Buffer]:
        """Run one parsed request's handler; every failure becomes an error reply."""
        return self._run(getattr(self, spec.handler), peer, req_id, msg, payloads)

    def try_inline(self, peer: bytes, req_id: int, spec: p.OpSpec, msg: msgspec.Struct,
                   payloads: p.Payloads) -> list[p.Buffer] | None:
        """The reply frames if the request can be answered now without blocking, else None."""
        name = spec.handler if spec.inline else _NOW.get(spec.handler)
        if name is None:
            return None
        try:
            return self._run(getattr(self, name), peer, req_id, msg, payloads)
        except _WouldBlock:
            return None

    def _run(self, handler: Any, peer: bytes, req_id: int, msg: msgspec.Struct,
             payloads: p.Payloads) -> list[p.Buffer]:
        try:
            reply, out = handler(peer, msg, payloads)
            return w.reply_frames(req_id, reply, out)
        except _WouldBlock:
            raise
        except ProtocolError as exc:
            return w.error_frames(req_id, exc.code, exc.message)
        except (LayoutError, ConfigError, msgspec.ValidationError) as exc:
            return w.error_frames(req_id, ErrorCode.BAD_REQUEST, str(exc))
        except IpcError as exc:
            return w.error_frames(req_id, ErrorCode.UNSUPPORTED, str(exc))
        except Exception as exc:  # the server boundary: log, answer, keep serving
            logger.exception("kvdepot server: request %d failed", req_id)
            return w.error_frames(req_id, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    def _session(self, peer: bytes) -> Session:
        with self._lock:
            session = self._sessions.get(peer)
        if session is None:
            raise ProtocolError(ErrorCode.NO_SESSION, "no session: send HELLO first (the server may have restarted)")
        session.last_seen = time.monotonic()
        return session

    # ---- session ------------------------------------------------------------------------------
    def hello(self, peer: bytes, msg: p.Hello, payloads: p.Payloads) -> p.Reply:
        if msg.version != p.PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"client speaks kvdepot protocol v{msg.version}, this server speaks v{p.PROTOCOL_VERSION}: "
                "run the same kvdepot version in the engine and the server",
            )
        session = Session(next(self._sids), peer, msg.client[:128], msg.pid)
        with self._lock:
            old = self._sessions.get(peer)
            self._sessions[peer] = session
        if old is not None:
            old.close()
        logger.info("kvdepot server: %s opened", session)
        return p.HelloReply(p.PROTOCOL_VERSION, session.sid, self.server_id, os.getpid()), []

    def end_session(self, peer: bytes, msg: p.EndSession, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        self._drop(session)
        return p.Empty(), []

    def _drop(self, session: Session) -> None:
        with self._lock:
            if self._sessions.get(session.peer) is session:
                del self._sessions[session.peer]
        session.close()

    def ping(self, peer: bytes, msg: p.Ping, payloads: p.Payloads) -> p.Reply:
        self._session(peer)
        return p.Pong(self.server_id, time.monotonic_ns()), []

    # ---- registration -----------------------------------------------------------------------
    def register(self, peer: bytes, msg: p.Register, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        for name, limit in _LIMITS.items():
            if not 0 < getattr(msg, name) <= limit:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {name}={getattr(msg, name)} not in 1..{limit}")
        if not 0 <= msg.tp_rank < msg.tp_size or len(msg.model_id) > 1024 or len(msg.cache_salt) > 1024:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: tp_rank {msg.tp_rank} / tp_size {msg.tp_size} or ids invalid")
        try:
            dtype = torch_dtype(msg.dtype)
        except IpcError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        try:
            layout = PoolLayout(msg.num_blocks, msg.num_layers, msg.kv_factor, msg.block_elems, dtype,
                                msg.tokens_per_block, self.config.chunk_size)
        except LayoutError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {exc} (the server's chunk_size is "
                                f"{self.config.chunk_size}; start it with --chunk-size to change it)") from None
        if layout.bytes_per_block != msg.bytes_per_block:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: bytes_per_block {msg.bytes_per_block} != "
                                f"{layout.bytes_per_block} computed from the geometry")
        layer_events = len(getattr(msg.pool, "layer_events", ()))
        if layer_events not in (0, layout.num_layers) or layer_events > MAX_LAYER_EVENTS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {layer_events} layer events for {layout.num_layers} "
                                f"layers (none, or one per layer up to {MAX_LAYER_EVENTS})")
        group = self._group(msg, layout)
        shard = group.shard(msg.tp_rank, layout, _cuda_index(msg.pool))
        shape = (layout.num_blocks, layout.num_layers, layout.kv_factor, layout.block_elems)
        pool = open_pool(msg.pool, shape, dtype, allow_shm=self.allow_shm)
        session.install(Registration(group, shard, layout, pool), self.session_timeout_s)
        logger.info("kvdepot server: %s registered rank %d/%d of %s (%s pool, %d blocks of %d B)", session,
                    msg.tp_rank, msg.tp_size, group.name, pool.kind, layout.num_blocks, layout.bytes_per_block)
        host_blocks = shard.engine.host.num_slots * layout.blocks_per_chunk
        disk_blocks = int(group.config.disk_capacity_gb * 1e9) // layout.bytes_per_block if group.config.disk_path else 0
        return p.RegisterReply(self.config.chunk_size, self.config.hash_algo, host_blocks, disk_blocks,
                               group.hasher.seed, group.name, self.events is not None), []

    def _group(self, msg: p.Register, layout: PoolLayout) -> Group:
        with self._lock:
            group = self._groups.get((msg.model_id, msg.cache_salt))
            if group is None:
                group = self._groups[(msg.model_id, msg.cache_salt)] = Group(msg, layout, self.config, self.events)
                return group
        group.check(msg, layout)
        return group

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, peer: bytes, msg: p.Lookup, payloads: p.Payloads, *, now: bool = False) -> p.Reply:
        if now and ((msg.tokens and not msg.keys) or len(msg.keys) > INLINE_KEYS * KEY_BYTES):
            raise _WouldBlock  # hashing tokens, or a very long prompt: not on the loop thread
        session = self._session(peer)
        reg = session.registration()
        if len(msg.keys) > MAX_CHUNKS * KEY_BYTES or len(msg.tokens) > MAX_CHUNKS * 16 or msg.skip_tokens < 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "LOOKUP: too many keys/tokens or a negative skip")
        keys = w.split_keys(msg.keys) if msg.keys else reg.group.hasher.chunk_keys(msg.tokens)
        if msg.tokens:  # the edge, server side: only chunks with known tokens are announced
            reg.shard.engine.describe(keys, msg.tokens)
        lease = session.lease(msg.request_id)
        hit = reg.group.try_probe(keys, msg.skip_tokens, lease) if now else reg.group.probe(keys, msg.skip_tokens, lease)
        if hit is None:
            raise _WouldBlock
        matched, ready = hit
        # Chunks found only in disk/Redis are being promoted into host memory: pending until then.
        status = p.PrefetchStatus(ready >= matched, matched, ready)
        session.put_prefetch(msg.request_id, status, self.config.lease_timeout_s)
        return status, []

    def lookup_now(self, peer: bytes, msg: p.Lookup, payloads: p.Payloads) -> p.Reply:
        return self.lookup(peer, msg, payloads, now=True)

    def query_prefetch_status(self, peer: bytes, msg: p.QueryPrefetch, payloads: p.Payloads) -> p.Reply:
        return self._session(peer).get_prefetch(msg.request_id), []

    def release(self, peer: bytes, msg: p.Release, payloads: p.Payloads) -> p.Reply:
        self._session(peer).drop_prefetch(msg.request_id)
        return p.Empty(), []

    def release_now(self, peer: bytes, msg: p.Release, payloads: p.Payloads) -> p.Reply:
        if not self._session(peer).drop_prefetch(msg.request_id, now=True):
            raise _WouldBlock
        return p.Empty(), []

    # ---- copies -------------------------------------------------------------------------------
    @staticmethod
    def _check_copy(keys: bytes, block_ids: list[int]) -> list[bytes]:
        if not 0 < len(block_ids) <= MAX_BLOCKS or len(keys) > MAX_CHUNKS * KEY_BYTES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"1..{MAX_BLOCKS} blocks and at most {MAX_CHUNKS} keys per copy")
        return w.split_keys(keys)

    def _payload_pool(self, reg: Registration, rows: int, payload: p.Buffer | None) -> torch.Tensor:
        layout = reg.layout
        if rows * layout.bytes_per_block > self.max_payload_bytes:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{rows} blocks exceed the {self.max_payload_bytes}-byte payload limit")
        shape = (rows, layout.num_layers, layout.kv_factor, layout.block_elems)
        if payload is None:
            return torch.empty(shape, dtype=layout.dtype)
        if len(memoryview(payload).cast("B")) != rows * layout.bytes_per_block:
            raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"payload of {len(memoryview(payload).cast('B'))} bytes; "
                                f"{rows} blocks of {layout.bytes_per_block} B expected")
        return frame_tensor(payload).view(layout.dtype).view(shape)

    def store(self, peer: bytes, msg: p.Store, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        reg = session.begin_op()
        try:
            keys = self._check_copy(msg.keys, msg.block_ids)
            if reg.pool.tensor is None:
                reg.layout.check_block_ids(msg.block_ids)  # unused by the server, but a client bug
                if len(payloads) != 1:
                    raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"a bytes-pool STORE carries 1 payload frame, got {len(payloads)}")
                pool = self._payload_pool(reg, len(msg.block_ids), payloads[0])
                handle = reg.shard.store(pool, keys, list(range(len(msg.block_ids))), transient=True)
            else:
                with _device(reg.pool.tensor):
                    reg.pool.wait_client(msg.synced)
                    handle = reg.shard.store(reg.pool.tensor, keys, msg.block_ids, stream=reg.pool.stream,
                                             deadline_ns=msg.deadline_ns)
            handle.wait()  # reply only once the blocks are copied: the client may then reuse them
            return p.StoreReply(handle.chunks), []
        finally:
            session.end_op()

    def retrieve(self, peer: bytes, msg: p.Retrieve, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        reg = session.begin_op()
        try:
            keys = self._check_copy(msg.keys, msg.block_ids)
            if msg.skip_blocks < 0 or (msg.num_blocks is not None and msg.num_blocks < 0):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"skip_blocks {msg.skip_blocks} / num_blocks {msg.num_blocks} < 0")
            lease = ("lease", msg.lease_session, msg.request_id) if msg.request_id is not None else None
            B = reg.layout.tokens_per_block
            if reg.pool.tensor is None:
                reg.layout.check_block_ids(msg.block_ids)
                pool = self._payload_pool(reg, len(msg.block_ids), None)
                ids = list(range(len(msg.block_ids)))
                end = reg.shard.retrieve(pool, keys, ids, msg.skip_blocks, msg.num_blocks, lease, transient=True)
                loaded = max(0, end // B - msg.skip_blocks)
                rows = pool[msg.skip_blocks : msg.skip_blocks + loaded].contiguous()
                return p.RetrieveReply(end, loaded), [memoryview(rows.view(torch.uint8).reshape(-1).numpy())]
            layered: list[bool] = []

            def signal(load: LayerWaits | None) -> None:  # what the client's stream will wait on
                if load is None:
                    reg.pool.signal_client()
                else:
                    reg.pool.signal_layers(load)
                    layered.append(True)

            by_layer = msg.by_layer and bool(reg.pool.layer_events)  # one per layer (checked at REGISTER)
            with _device(reg.pool.tensor):
                reg.pool.wait_client(msg.synced)
                end = reg.shard.retrieve(reg.pool.tensor, keys, msg.block_ids, msg.skip_blocks, msg.num_blocks, lease,
                                         stream=reg.pool.stream, after=signal, by_layer=by_layer,
                                         deadline_ns=msg.deadline_ns)
            return p.RetrieveReply(end, max(0, end // B - msg.skip_blocks), bool(layered)), []
        finally:
            session.end_op()

    # ---- upkeep and figures ----------------------------------------------------------------------
    def reap(self) -> None:
        """Close sessions silent for ``session_timeout_s``; drop lookups past their lease timeout."""
        now = time.monotonic()
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            if now - session.last_seen > self.session_timeout_s:
                logger.warning("kvdepot server: %s silent for %.1f s; releasing its leases and pool",
                               session, now - session.last_seen)
                self._drop(session)
            else:
                session.expire_prefetch(now)

    def close(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            session.close(drain_s=5.0)
        for group in list(self._groups.values()):
            for shard in group.shards.values():
                shard.engine.close()
        if self.events is not None:
            self.events.close()

    def stats(self, peer: bytes, msg: p.GetStats, payloads: p.Payloads) -> p.Reply:
        self._session(peer)
        return self.snapshot(), []

    def snapshot(self) -> p.StatsReply:
        with self._lock:
            sessions = list(self._sessions.values())
            groups = list(self._groups.values())
        shards = [p.ShardStats(group.name, rank, _figures(shard.engine.stats()))
                  for group in groups for rank, shard in sorted(group.shards.items())]
        mappings = sum(1 for s in sessions if s.reg is not None and s.reg.pool.tensor is not None)
        prefetches = sum(len(s.prefetch) for s in sessions)
        return p.StatsReply(self.server_id, os.getpid(), self.url, time.monotonic() - self.started,
                            len(sessions), mappings, prefetches, shards)


class _WouldBlock(Exception):  # a signal between try_inline and its handlers, not an error
    """The operation cannot finish without waiting: run it on the pool instead."""


_NOW = {"lookup": "lookup_now", "release": "release_now"}  # non-blocking variants, for try_inline


def _figures(stats: object) -> dict[str, float]:
    """Numeric fields of ``EngineStats``; lower tiers' rows flattened as ``<tier>_<field>``."""
    out: dict[str, float] = {}
    for key, value in asdict(stats).items():  # type: ignore[call-overload]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, list):  # EngineStats.lower: one TierStats row per lower tier
            for row in value:
                name = row.get("name", "tier") if isinstance(row, dict) else "tier"
                out.update({f"{name}_{k}": float(v) for k, v in row.items() if isinstance(v, (int, float))})
    return out


def _cuda_index(desc: p.PoolDesc) -> int | None:
    """The local index of a CUDA pool's GPU, or None (not CUDA, or not visible here)."""
    if not isinstance(desc, p.CudaIpcPool) or not torch.cuda.is_available():
        return None
    try:
        return device_by_uuid(desc.device_uuid)
    except IpcError:
        return None


def _device(tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """The tensor's CUDA device as the current one (streams and events live there)."""
    import contextlib

    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
