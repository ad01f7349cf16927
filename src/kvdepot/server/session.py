"""One client's state on the server: its registration, mapped pool, lookups, and in-flight copies.

A session's leases are its own: another session may name them (a vLLM worker loads under its
scheduler's lease) only with the session's ``token``, a random secret its LOOKUP replies carry —
session ids are sequential and guessable, the token is not.

A session starts with HELLO and ends with END_SESSION, a new HELLO from the same peer, or
``session_timeout_s`` without any message (a client killed with -9 sends nothing, so its
heartbeats stop). Closing a session releases its leases and prefetch entries, waits for its
in-flight copies, detaches its pool from the shard's engine and closes the mapping (CUDA IPC
handle, shared file) — in that order, so no copy ever touches unmapped memory.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

from kvdepot.layout import PoolLayout
from kvdepot.server.ipc import MappedPool
from kvdepot.server.protocol import ErrorCode, PrefetchStatus, ProtocolError
from kvdepot.server.shard import Group, Shard

logger = logging.getLogger("kvdepot")

MAX_PREFETCHES = 65536  # live lookups per session


@dataclass
class Prefetch:
    status: PrefetchStatus
    expires: float


@dataclass(frozen=True)
class Registration:
    group: Group
    shard: Shard
    layout: PoolLayout
    pool: MappedPool


class Session:
    """Thread-safe: handlers on the pool and the reaper all reach it."""

    def __init__(self, sid: int, peer: bytes, client: str, pid: int) -> None:
        self.sid, self.peer, self.client, self.pid = sid, peer, client, pid
        self.last_seen = time.monotonic()
        self.reg: Registration | None = None
        self.prefetch: dict[int, Prefetch] = {}
        self.closed = False
        self.token = secrets.token_bytes(16)  # who holds it may use this session's leases
        self._ops = 0
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"session {self.sid} ({self.client or 'client'} pid {self.pid})"

    def lease(self, request_id: int) -> tuple[str, int, int]:
        return ("lease", self.sid, request_id)

    def grants(self, token: bytes) -> bool:
        """Whether ``token`` is this session's (constant time: no byte-by-byte guessing)."""
        return not self.closed and hmac.compare_digest(token, self.token)

    # ---- data operations --------------------------------------------------------------------
    def begin_op(self) -> Registration:
        """Enter a copy: the registration stays mapped until ``end_op``."""
        with self._cond:
            if self.closed:
                raise ProtocolError(ErrorCode.NO_SESSION, f"{self} is closed; send HELLO again")
            if self.reg is None:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "REGISTER a KV pool before STORE/RETRIEVE/LOOKUP")
            self._ops += 1
            return self.reg

    def end_op(self) -> None:
        with self._cond:
            self._ops -= 1
            self._cond.notify_all()

    def registration(self) -> Registration:
        reg = self.reg
        if reg is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, "REGISTER a KV pool before LOOKUP")
        return reg

    def install(self, reg: Registration, drain_s: float) -> Registration | None:
        """Replace the registration (a worker re-registering); the old pool is unmapped and the
        old registration returned (its group loses a member)."""
        with self._cond:
            if self.closed:
                reg.pool.close()
                raise ProtocolError(ErrorCode.NO_SESSION, f"{self} closed while registering")
            old, self.reg = self.reg, reg
        if old is not None:
            self._drain(drain_s)
            _unmap(old)
        return old

    # ---- lookups ------------------------------------------------------------------------------
    def put_prefetch(self, request_id: int, status: PrefetchStatus, ttl_s: float) -> None:
        with self._cond:
            if request_id not in self.prefetch and len(self.prefetch) >= MAX_PREFETCHES:
                raise ProtocolError(ErrorCode.BUSY, f"{MAX_PREFETCHES} lookups are live; RELEASE finished requests")
            self.prefetch[request_id] = Prefetch(status, time.monotonic() + ttl_s)

    def get_prefetch(self, request_id: int) -> PrefetchStatus:
        """The lookup's status; a pending one turns done once every rank's promotion finished."""
        with self._cond:
            entry = self.prefetch.get(request_id)
        if entry is None:
            raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"no lookup for request id {request_id} in {self}")
        reg = self.reg
        lease = self.lease(request_id)
        if not entry.status.done and reg is not None and reg.group.promotions_done(lease):
            # What is in host memory now: the host part found at LOOKUP plus what the promotion
            # read. A promotion that stopped short (corrupt chunk, arena full of pinned chunks)
            # shrinks the match — a load must never be promised chunks that are not there.
            status, promoted = entry.status, reg.group.promoted_chunks(lease)
            ready = status.matched_tokens if promoted is None else min(
                status.matched_tokens, status.ready_tokens + promoted * reg.layout.chunk_size)
            entry.status = PrefetchStatus(True, ready, ready)
        return entry.status

    def drop_prefetch(self, request_id: int, *, wait: bool = True) -> bool:
        """Drop a lookup's state and leases; without ``wait``, only if no engine lock must be
        waited for (False, and nothing dropped, otherwise)."""
        reg = self.reg
        if reg is not None:
            lease = self.lease(request_id)
            if wait:
                reg.group.release(lease)
            elif not reg.group.try_release(lease):
                return False
        with self._cond:
            self.prefetch.pop(request_id, None)
        return True

    def expire_prefetch(self, now: float) -> int:
        with self._cond:
            gone = [rid for rid, entry in self.prefetch.items() if entry.expires <= now]
        for rid in gone:
            self.drop_prefetch(rid)
        return len(gone)

    # ---- teardown -----------------------------------------------------------------------------
    def _drain(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._ops == 0, timeout=timeout_s)

    def close(self, drain_s: float = 30.0, *, reaped: bool = False) -> Registration | None:
        """Release leases, wait for in-flight copies, unmap; the registration so released is
        returned (None: there was none, or it stays mapped). Idempotent.

        ``reaped`` (the client went silent): if its process is gone too, its shared pool file is
        removed — a client killed with -9 cannot, and the file would hold its memory for good.
        """
        with self._cond:
            if self.closed:
                return None
            self.closed = True
            rids = list(self.prefetch)
            self.prefetch.clear()
        reg = self.reg
        if reg is not None:
            for rid in rids:
                reg.group.release(self.lease(rid))
        if not self._drain(drain_s):
            # A copy that never finishes (a hung GPU) must not become a crash: keep the mapping.
            logger.error("kvdepot: %s still has copies in flight after %.0f s; its pool stays mapped", self, drain_s)
            return None
        self.reg = None
        if reg is not None:
            _unmap(reg)
            if reaped and not _alive(self.pid) and reg.pool.remove_file():
                logger.info("kvdepot server: removed the shared pool file of %s (its process is gone)", self)
        return reg


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (unknown, 0, counts as alive: nothing is removed then)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return True
    return True


def _unmap(reg: Registration) -> None:
    if reg.pool.tensor is not None:
        reg.shard.detach(reg.pool.tensor)
    reg.pool.close()
