"""The client: bounded calls to a kvdepot server that never take the engine down with it.

    DepotClient(url, timeout_s=2.0, heartbeat_s=1.0)
      .call(msg, payloads) -> (reply, payloads)   blocks at most timeout_s
      .submit(msg, payloads) -> Future             the same, without waiting
      .on_connect(fn) / .remove_hook(fn)           replayed after every HELLO (e.g. REGISTER)
      .ready / .session_id / .close()
    print_stats(url) -> exit code                  ``kvdepot stats``

One I/O thread owns a DEALER socket; callers hand it frames through a queue and a wake-up pipe
and wait on futures keyed by request id, so a late reply is simply dropped (a REQ socket would
be stuck after a timeout). A keeper thread PINGs every ``heartbeat_s`` — which also keeps the
server-side session alive — and re-runs HELLO plus the ``on_connect`` hooks whenever the server
is back or has restarted (a new server id, or a NO_SESSION error).

While the server is unreachable every call fails at once with ``ServerUnavailable`` (the
socket has ZMQ_IMMEDIATE set, so nothing queues for a dead peer) and exactly one warning is
logged per outage; callers answer "0 hits" and skip their stores.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import IO

import msgspec
import zmq

from kvdepot.errors import KVDepotError, TierUnavailable
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.metrics import format_stats
from kvdepot.server.paths import check_url, default_url

logger = logging.getLogger("kvdepot")

Result = tuple[msgspec.Struct, list[memoryview]]


class ServerUnavailable(TierUnavailable):
    """No (timely) answer from the server; the caller treats it as a miss."""


class ServerError(KVDepotError):
    """The server answered with an error reply."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{p.ErrorCode(code).name if code in p.ErrorCode._value2member_map_ else code}: {message}")
        self.code, self.message = code, message


@dataclass
class _Call:
    future: Future
    reply: type[msgspec.Struct]
    deadline: float


class DepotClient:
    """A connection to one server, shared by every thread of the process that uses it."""

    def __init__(self, url: str | None = None, *, timeout_s: float = 2.0, heartbeat_s: float = 1.0,
                 name: str = "kvdepot", connect: bool = True, log_outages: bool = True) -> None:
        self.url = check_url(url or default_url())
        self.timeout_s, self.heartbeat_s, self.name = timeout_s, heartbeat_s, name
        self.session_id, self.server_id = 0, 0
        self._ctx = zmq.Context()
        self._outbox: queue.SimpleQueue[tuple[int, list[p.Buffer]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._calls: dict[int, _Call] = {}
        self._calls_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._hooks: list[Callable[[], None]] = []
        self._ready = threading.Event()
        self._retry = threading.Event()
        self._closed = threading.Event()
        self._handshake_lock = threading.Lock()
        self._warned = not log_outages  # True: the one warning per outage has been logged
        self._log_outages = log_outages
        self._io = threading.Thread(target=self._io_loop, name="kvdepot-client-io", daemon=True)
        self._io.start()
        self._keeper = threading.Thread(target=self._keep, name="kvdepot-client-keeper", daemon=True)
        self._keeper.start()
        if connect:
            self.connect()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` after every successful HELLO (now, if connected). It may raise to fail it."""
        self._hooks.append(hook)
        if self.ready:
            try:
                hook()
            except KVDepotError as exc:
                self._mark_down(f"registration failed: {exc}")

    def remove_hook(self, hook: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._hooks.remove(hook)

    # ---- calls ---------------------------------------------------------------------------------
    def submit(self, msg: msgspec.Struct, payloads: Sequence[p.Buffer] = (), *, timeout: float | None = None,
               handshake: bool = False) -> Future:
        future: Future = Future()
        if self._closed.is_set() or not (handshake or self._ready.is_set()):
            future.set_exception(ServerUnavailable(f"kvdepot server {self.url} is not connected"))
            return future
        op = p.OP_OF[type(msg)]
        req_id = next(self._ids)
        with self._calls_lock:
            deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
            self._calls[req_id] = _Call(future, p.OPS[op].reply, deadline)
        self._outbox.put((req_id, w.request_frames(op, req_id, msg, payloads)))
        self._wake()
        return future

    def call(self, msg: msgspec.Struct, payloads: Sequence[p.Buffer] = (), *, timeout: float | None = None,
             handshake: bool = False) -> Result:
        """Send and wait for the reply; ``ServerUnavailable`` or ``ServerError`` on failure."""
        future = self.submit(msg, payloads, timeout=timeout, handshake=handshake)
        wait = (self.timeout_s if timeout is None else timeout) + 1.0  # the I/O thread expires it first
        try:
            return future.result(wait)
        except FutureTimeout:
            raise ServerUnavailable(f"no reply from {self.url} in {wait:.1f} s") from None

    def _settle(self, req_id: int, result: Result | None = None, error: BaseException | None = None) -> None:
        with self._calls_lock:
            call = self._calls.pop(req_id, None)
        if call is None:
            return  # expired already: a late reply is dropped
        lost = isinstance(error, ServerUnavailable) or (isinstance(error, ServerError) and error.code == p.ErrorCode.NO_SESSION)
        if lost and not self._closed.is_set():
            self._mark_down(str(error))
        if lost:
            error = error if isinstance(error, ServerUnavailable) else ServerUnavailable(str(error))
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    # ---- the I/O thread (the only one touching the socket) -------------------------------------
    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.RECONNECT_IVL, 100),
                              (zmq.RECONNECT_IVL_MAX, 1000), (zmq.SNDHWM, 10000), (zmq.RCVHWM, 10000)):
            sock.setsockopt(option, value)
        sock.connect(self.url)
        return sock

    def _io_loop(self) -> None:
        sock = self._socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        unsent: deque[tuple[int, list[p.Buffer]]] = deque()
        while not self._closed.is_set():
            events = dict(poller.poll(10 if unsent else 50))
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 1 << 16)
            while True:
                try:
                    unsent.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            self._send(sock, unsent)
            if sock in events:
                self._read_replies(sock)
            self._expire()
        sock.close(0)
        with self._calls_lock:
            left = list(self._calls)
        for req_id in left:
            self._settle(req_id, error=ServerUnavailable("client closed"))

    def _send(self, sock: zmq.Socket, unsent: deque[tuple[int, list[p.Buffer]]]) -> None:
        """Send in order; with ZMQ_IMMEDIATE a message waits here (until its deadline) for a live
        connection instead of queueing inside ZMQ for a peer that may be dead."""
        while unsent:
            req_id, frames = unsent[0]
            with self._calls_lock:
                live = req_id in self._calls
            if live:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
            unsent.popleft()

    def _read_replies(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = w.parse_reply_header(frames[0].buffer)
                with self._calls_lock:
                    call = self._calls.get(header.req_id)
                if call is None:
                    continue
                if header.status:
                    err = w.decode(frames[1].buffer, p.ErrorReply)
                    self._settle(header.req_id, error=ServerError(err.code, err.message))  # type: ignore[attr-defined]
                else:
                    body = w.decode(frames[1].buffer, call.reply)
                    self._settle(header.req_id, (body, [f.buffer for f in frames[2:]]))
            except (msgspec.MsgspecError, IndexError) as exc:
                logger.warning("kvdepot: undecodable reply from %s dropped: %s", self.url, exc)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._calls_lock:
            late = [req_id for req_id, call in self._calls.items() if call.deadline <= now]
        for req_id in late:
            self._settle(req_id, error=ServerUnavailable(f"no reply from {self.url} within {self.timeout_s:g} s"))

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # ---- health ----------------------------------------------------------------------------------
    def _mark_down(self, reason: str) -> None:
        self._ready.clear()
        self._retry.set()
        if not self._warned:
            self._warned = True
            logger.warning("kvdepot: server %s unavailable (%s); lookups miss and stores are skipped "
                           "until it is back", self.url, reason)

    def connect(self) -> bool:
        """HELLO (then the on_connect hooks) now; False, with one warning, if the server is not there."""
        with self._handshake_lock:
            if self.ready:
                return True
            try:
                hello, _ = self.call(p.Hello(p.PROTOCOL_VERSION, self.name, os.getpid()), handshake=True)
                self.session_id, self.server_id = hello.session_id, hello.server_id  # type: ignore[attr-defined]
                for hook in list(self._hooks):
                    hook()
            except KVDepotError as exc:
                self._mark_down(str(exc))
                return False
            self._ready.set()
            if self._warned and self._log_outages:
                self._warned = False
                logger.info("kvdepot: reconnected to server %s (session %d)", self.url, self.session_id)
            return True

    def _keep(self) -> None:
        while not self._closed.is_set():
            try:
                self._keep_once()
            except Exception:  # the client's boundary: a broken hook must not end the heartbeats
                logger.exception("kvdepot: client upkeep failed")
                self._closed.wait(self.heartbeat_s)

    def _keep_once(self) -> None:
        """One heartbeat: PING when connected (a new server id means a restart), else reconnect."""
        self._retry.wait(self.heartbeat_s)
        if self._closed.is_set():
            return
        self._retry.clear()
        if not self.ready:
            self.connect()
            self._retry.clear()  # a failed attempt waits a heartbeat before the next one
            return
        try:
            pong, _ = self.call(p.Ping(), timeout=min(self.timeout_s, max(self.heartbeat_s, 0.2)))
            if pong.server_id != self.server_id:  # type: ignore[attr-defined]
                self._mark_down("the server restarted")
        except ServerUnavailable:
            pass  # already marked down
        except ServerError as exc:
            self._mark_down(str(exc))

    def close(self) -> None:
        if self._closed.is_set():
            return
        if self.ready:
            with contextlib.suppress(KVDepotError):
                self.call(p.EndSession(), timeout=min(0.5, self.timeout_s))
        self._ready.clear()
        self._closed.set()
        self._retry.set()
        self._wake()
        self._io.join(2.0)
        self._keeper.join(2.0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ctx.term()


def print_stats(url: str | None = None, file: IO[str] | None = None, timeout_s: float = 2.0) -> int:
    """Print a running server's live figures; 0 on success, 1 if no server answers."""
    url = url or default_url()
    client = DepotClient(url, timeout_s=timeout_s, heartbeat_s=3600.0, name="kvdepot-stats", connect=False,
                         log_outages=False)
    try:
        if not client.connect():
            print(f"kvdepot: no server answering at {url}", file=sys.stderr)
            return 1
        stats, _ = client.call(p.GetStats())
        print(format_stats(stats), file=file or sys.stdout)  # type: ignore[arg-type]
        return 0
    except KVDepotError as exc:
        print(f"kvdepot: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
