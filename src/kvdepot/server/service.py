"""The server's handlers (``protocol.DepotProtocol``): sessions, model groups, copies.

Transport-free: ``handle(peer, frames)`` takes a request's frames and returns the reply's, so
the ZMQ loop (``server.py``) and tests drive the same code. Every failure becomes an error
reply with a code and a message; nothing a client sends can take the service down.

Each operation's handler is bound once, at construction (``protocol.bind``), and where it runs
is the protocol's word (``OpSpec.mode``): ``try_inline`` answers on the caller's (the loop's)
thread the INLINE operations (PING, QUERY_PREFETCH_STATUS) and tries the TRY_INLINE ones with
``wait=False`` — LOOKUP (by keys, at most ``protocol.INLINE_KEYS``) and RELEASE finish there when
every engine involved has no lower tier (disk/Redis lookups may wait on I/O) and its lock is
free right now; anything else is left for the pool (None).
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

import msgspec
import torch

from kvdepot.config import DepotConfig
from kvdepot.errors import ConfigError, LayoutError
from kvdepot.events.publisher import publisher_from_config
from kvdepot.keys import KEY_BYTES
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.copy_fence import Admission
from kvdepot.server.ipc import IpcError, frame_tensor
from kvdepot.server.layer_progress import LayerProgress, LoadBook, start_early
from kvdepot.server.protocol import ErrorCode, ProtocolError
from kvdepot.server.registry import Registry
from kvdepot.server.session import Registration, Session
from kvdepot.transfer.layered import LayerWaits

logger = logging.getLogger("kvdepot")


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
        self.events = publisher_from_config(config)  # one KV-event publisher for every engine here
        self.registry = Registry(config, allow_shm=self.allow_shm, events=self.events)  # groups, host budget
        self._sids = itertools.count(1)
        self._load_ids = itertools.count(1)  # loads by layer answered early (LAYERS names them)
        self.layer_loads = LoadBook()
        self._handlers = p.bind(self)  # every operation's handler, looked up once

    # ---- dispatch -----------------------------------------------------------------------------
    def handle(self, peer: bytes, frames: Sequence[p.Buffer]) -> list[p.Buffer]:
        """Reply frames for one request's frames; never raises."""
        try:
            header, spec = w.parse_header(frames)
        except ProtocolError as exc:
            return w.error_frames(exc.req_id, exc.code, exc.message)
        return self.decode_and_dispatch(peer, header.req_id, spec, frames[1], frames[2:])

    def decode_and_dispatch(self, peer: bytes, req_id: int, spec: p.OpSpec, body: p.Buffer,
                            payloads: p.Payloads) -> list[p.Buffer]:
        """Decode a body ``wire.parse_header`` has bounded, then run it (on the pool: a large body
        is decoded here, never on the loop thread); every failure becomes an error reply."""
        try:
            msg = w.decode_body(p.RequestHeader(spec.op, req_id), spec, body)
        except ProtocolError as exc:
            return w.error_frames(req_id, exc.code, exc.message)
        except Exception as exc:  # the server boundary (MemoryError included): answer, keep serving
            return _internal(req_id, exc)
        return self.dispatch(peer, req_id, spec, msg, payloads)

    def dispatch(self, peer: bytes, req_id: int, spec: p.OpSpec, msg: msgspec.Struct,
                 payloads: p.Payloads) -> list[p.Buffer]:
        """Run one parsed request's handler; every failure becomes an error reply."""
        return self._run(self._handlers[spec.op].run, peer, req_id, msg, payloads)

    def try_inline(self, peer: bytes, req_id: int, spec: p.OpSpec, msg: msgspec.Struct,
                   payloads: p.Payloads) -> list[p.Buffer] | None:
        """The reply frames if the operation's mode lets it run on this (the loop's) thread and it
        can finish now without waiting; else None, and nothing was done."""
        now = self._handlers[spec.op].now
        if now is None:
            return None
        try:
            return self._run(now, peer, req_id, msg, payloads)
        except p.WouldBlock:
            return None

    def _run(self, handler: p.Handler, peer: bytes, req_id: int, msg: msgspec.Struct,
             payloads: p.Payloads) -> list[p.Buffer]:
        try:
            reply, out = handler(peer, msg, payloads)
            return w.reply_frames(req_id, reply, out)
        except p.WouldBlock:
            raise
        except ProtocolError as exc:
            return w.error_frames(req_id, exc.code, exc.message)
        except (LayoutError, ConfigError, msgspec.ValidationError) as exc:
            return w.error_frames(req_id, ErrorCode.BAD_REQUEST, str(exc))
        except IpcError as exc:
            return w.error_frames(req_id, ErrorCode.UNSUPPORTED, str(exc))
        except Exception as exc:  # the server boundary (MemoryError included): log, answer, keep serving
            return _internal(req_id, exc)

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
            self._close(old)
        logger.info("kvdepot server: %s opened", session)
        return p.HelloReply(p.PROTOCOL_VERSION, session.sid, self.server_id, os.getpid()), []

    def end_session(self, peer: bytes, msg: p.EndSession, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        self._drop(session)
        return p.Empty(), []

    def _drop(self, session: Session, *, reaped: bool = False) -> None:
        with self._lock:
            if self._sessions.get(session.peer) is session:
                del self._sessions[session.peer]
        self._close(session, reaped=reaped)

    def _close(self, session: Session, drain_s: float = 30.0, *, reaped: bool = False) -> None:
        reg = session.close(drain_s, reaped=reaped)
        self.layer_loads.drop(session.sid)
        if reg is not None:
            self.registry.leave(reg)

    def ping(self, peer: bytes, msg: p.Ping, payloads: p.Payloads) -> p.Reply:
        self._session(peer)
        return p.Pong(self.server_id, time.monotonic_ns()), []

    # ---- registration -----------------------------------------------------------------------
    def register(self, peer: bytes, msg: p.Register, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        reply = self.registry.register(session, msg, self.session_timeout_s)
        reg = session.reg
        if reg is not None and reg.pool.progress is not None:  # the client reads its loads' progress there
            reply = msgspec.structs.replace(reply, progress_page=True)
        if reg is not None and reg.pool.fence is not None:  # its copies may carry tickets
            reply = msgspec.structs.replace(reply, fence=True)
        return reply, []

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, peer: bytes, msg: p.Lookup, payloads: p.Payloads, *, wait: bool = True) -> p.Reply:
        if not wait and ((msg.tokens and not msg.keys) or len(msg.keys) > p.INLINE_KEYS * KEY_BYTES):
            raise p.WouldBlock  # hashing tokens, or a very long prompt: not on the loop thread
        session = self._session(peer)
        reg = session.registration()
        if len(msg.keys) > p.MAX_KEYS * KEY_BYTES or len(msg.tokens) > p.MAX_TOKENS or msg.skip_tokens < 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "LOOKUP: too many keys/tokens or a negative skip")
        keys = w.split_keys(msg.keys) if msg.keys else reg.group.hasher.chunk_keys(msg.tokens)
        if msg.tokens:  # the edge, server side: only chunks with known tokens are announced
            reg.shard.engine.describe(keys, msg.tokens)
        lease = session.lease(msg.request_id)
        hit = reg.group.probe(keys, msg.skip_tokens, lease) if wait else reg.group.try_probe(keys, msg.skip_tokens, lease)
        if hit is None:
            raise p.WouldBlock
        matched, ready = hit
        # Chunks found only in disk/Redis are being promoted into host memory: pending until then.
        status = p.PrefetchStatus(ready >= matched, matched, ready)
        session.put_prefetch(msg.request_id, status, self.config.lease_timeout_s)
        return p.PrefetchStatus(status.done, matched, ready, session.token), []

    def query_prefetch_status(self, peer: bytes, msg: p.QueryPrefetch, payloads: p.Payloads) -> p.Reply:
        return self._session(peer).get_prefetch(msg.request_id), []

    def release(self, peer: bytes, msg: p.Release, payloads: p.Payloads, *, wait: bool = True) -> p.Reply:
        if not self._session(peer).drop_prefetch(msg.request_id, wait=wait):
            raise p.WouldBlock
        return p.Empty(), []

    # ---- copies -------------------------------------------------------------------------------
    @staticmethod
    def _check_copy(keys: bytes, block_ids: list[int]) -> list[bytes]:
        if not 0 < len(block_ids) <= p.MAX_BLOCKS or len(keys) > p.MAX_KEYS * KEY_BYTES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"1..{p.MAX_BLOCKS} blocks and at most {p.MAX_KEYS} keys per copy")
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
                handle.wait()
                return p.StoreReply(handle.chunks), []
            admission = reg.pool.admit(msg.ticket, msg.deadline_ns)
            try:
                with _device(reg.pool.tensor):
                    reg.pool.wait_client(msg.synced)
                    handle = reg.shard.store(reg.pool.tensor, keys, msg.block_ids, stream=reg.pool.stream,
                                             admission=admission)
                handle.wait()  # reply only once the blocks are copied: the client may then reuse them
            finally:
                admission.leave()  # the copy is over: an abandoning client may have the blocks back
            return p.StoreReply(handle.chunks), []
        finally:
            session.end_op()

    def retrieve(self, peer: bytes, msg: p.Retrieve, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        reg = session.begin_op()
        early: list[tuple[int, int]] = []  # (load id, layers recorded) of a load answered early
        admission = reg.pool.admit(msg.ticket, msg.deadline_ns)
        try:
            keys = self._check_copy(msg.keys, msg.block_ids)
            if not 0 <= msg.skip_blocks <= p.MAX_BLOCKS or not 0 <= (msg.num_blocks or 0) <= p.MAX_BLOCKS:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"skip_blocks {msg.skip_blocks} / num_blocks {msg.num_blocks} "
                                    f"not in 0..{p.MAX_BLOCKS}")
            lease = self._lease(session, msg)
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
            by_layer = msg.by_layer and bool(reg.pool.layer_events)  # one per layer (checked at REGISTER)

            def signal(load: LayerWaits | None) -> None:  # what the client's stream will wait on
                if load is None:
                    reg.pool.signal_client()
                elif msg.early:
                    early.append(self._answer_early(session, reg, load, admission))
                else:
                    reg.shard.issuer.drain()  # an early load's records of these events come first
                    reg.pool.signal_layers(load)
                layered.append(load is not None)

            with _device(reg.pool.tensor):
                reg.pool.wait_client(msg.synced)
                end = reg.shard.retrieve(reg.pool.tensor, keys, msg.block_ids, msg.skip_blocks, msg.num_blocks, lease,
                                         stream=reg.pool.stream, after=signal, admission=admission,
                                         on_layer=reg.pool.record_layer_on if by_layer else None)
            load_id, ready = early[0] if early else (0, 0)
            return p.RetrieveReply(end, max(0, end // B - msg.skip_blocks), any(layered), load_id, ready), []
        finally:
            if not early:  # an early load's op (and copy) ends on the issuer, once its last layer is recorded
                admission.leave()
                session.end_op()

    def _answer_early(self, session: Session, reg: Registration, load: LayerWaits,
                      admission: Admission) -> tuple[int, int]:
        """Leave the load's layers to the shard's issuer (``layer_progress``): the reply goes
        before they are enqueued (all of them where the client reads the progress page, else all
        but layer 0). Runs under the shard's lock."""
        pool = reg.pool

        def end() -> None:
            admission.leave()
            session.end_op()

        progress = LayerProgress(next(self._load_ids), load.num_layers, admission.deadline_ns, pool.progress)
        start_early(load, progress, reg.shard.issuer, pool.record_layer, pool.stream, end,
                    lambda: _device(pool.tensor))  # type: ignore[arg-type]
        self.layer_loads.add(session.sid, progress)
        return progress.load_id, progress.recorded

    def layers(self, peer: bytes, msg: p.Layers, payloads: p.Payloads, *, wait: bool = True) -> p.Reply:
        """How far an early-answered load's layer events are recorded; waits (on the pool) until
        layer ``through`` is, the load ends, or ``layer_progress.MAX_WAIT_S`` passes."""
        session = self._session(peer)
        progress = self.layer_loads.get(session.sid, msg.load_id)
        if progress is None:
            raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"no layered load {msg.load_id} in {session}")
        if not wait and not progress.past(msg.through):
            raise p.WouldBlock
        return p.LayersReply(*progress.wait_past(msg.through)), []

    def _lease(self, session: Session, msg: p.Retrieve) -> tuple[str, int, int] | None:
        """The lease a RETRIEVE names: this session's, or another's whose token it carries."""
        if msg.request_id is None:
            return None
        owner = msg.lease_session or session.sid
        if owner != session.sid:
            with self._lock:
                other = next((s for s in self._sessions.values() if s.sid == owner), None)
            if other is None or not other.grants(msg.lease_token):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"RETRIEVE names a lease of session {owner} without "
                                    "that session's token (pass the lease_token its LOOKUP returned)")
        return ("lease", owner, msg.request_id)

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
                self._drop(session, reaped=True)
            else:
                session.expire_prefetch(now)

    def close(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            session.close(drain_s=5.0)
        self.registry.close()
        if self.events is not None:
            self.events.close()

    def stats(self, peer: bytes, msg: p.GetStats, payloads: p.Payloads) -> p.Reply:
        self._session(peer)
        return self.snapshot(), []

    def snapshot(self) -> p.StatsReply:
        with self._lock:
            sessions = list(self._sessions.values())
        groups = self.registry.groups()
        shards = [p.ShardStats(group.name, rank, _figures(shard.engine.stats()))
                  for group in groups for rank, shard in sorted(group.shards.items())]
        mappings = sum(1 for s in sessions if s.reg is not None and s.reg.pool.tensor is not None)
        prefetches = sum(len(s.prefetch) for s in sessions)
        return p.StatsReply(self.server_id, os.getpid(), self.url, time.monotonic() - self.started,
                            len(sessions), mappings, prefetches, shards)


def _internal(req_id: int, exc: Exception) -> list[p.Buffer]:
    logger.error("kvdepot server: request %d failed", req_id, exc_info=exc)
    return w.error_frames(req_id, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


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


def _device(tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """The tensor's CUDA device as the current one (streams and events live there)."""
    import contextlib

    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
