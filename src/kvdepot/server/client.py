"""The client: bounded calls to a kvdepot server that never take the engine down with it.

    DepotClient(url, timeout_s=2.0, heartbeat_s=1.0)
      .call(msg, payloads) -> (reply, payloads)   blocks at most timeout_s
      .submit(msg, payloads) -> Future             the same, without waiting
      .on_connect(fn) / .remove_hook(fn)           replayed after every HELLO (e.g. REGISTER)
      .ready / .session_id / .close()
    ServerUnavailable / ServerError                how calls fail (``calls.py``)
Framing on the shared socket is ``frames.py``; ``kvdepot stats`` is ``stats_cmd.py``.

One DEALER socket per client, shared by the threads that use it under a lock that is held only
for non-blocking socket operations. No hand-off between threads on a call: the calling thread
sends its request itself, and a thread that needs the reply reads the socket itself —
``result()`` on the future (``call`` uses it) sleeps in ``poll`` on the socket's notification
fd (``ZMQ_FD``), never on the socket, and ``done()`` drains without waiting. Whoever drains
settles every call whose reply it finds, and wakes that call's waiting thread through a
per-thread pipe (the fd will not signal that reply a second time). Replies are matched by
request id, so a late reply is simply dropped (a REQ socket would be stuck after a timeout).

Rule of the shared socket: every holder of the lock drains before it lets go (receives until
``ZMQ_EVENTS``, which processes pending commands, shows nothing to read), since any ZMQ call may
consume the fd's readiness; after that the fd turns readable on the next arrival, so no reply
waits unseen by a thread polling the fd.

An I/O thread ticks every 50 ms (at once when woken): it offers again what ZMQ could not take
(no live connection yet: with ZMQ_IMMEDIATE nothing queues inside ZMQ for a dead peer), drains
replies nobody asked for (fire-and-forget RELEASE), and expires calls past their deadline. A
keeper thread PINGs every ``heartbeat_s`` — which also keeps the server-side session alive — and
re-runs HELLO plus the ``on_connect`` hooks whenever the server is back or has restarted (a new
server id, or a NO_SESSION error). While the server is unreachable every call fails at once with
``ServerUnavailable`` and exactly one warning is logged per outage; callers answer "0 hits" and
skip their stores.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import zmq

from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.auth import client_curve, config_curve_dir
from kvdepot.server.calls import Call, Reply, ServerError, ServerUnavailable
from kvdepot.server.frames import readable, recv_frames, send_frames
from kvdepot.server.paths import check_url, default_url

logger = logging.getLogger("kvdepot")

# ServerError/ServerUnavailable are raised to callers; the framing stays importable from here too.
__all__ = ["DepotClient", "ServerError", "ServerUnavailable", "readable", "recv_frames", "send_frames"]

Result = tuple[msgspec.Struct, list[memoryview]]

_IDLE_POLL_S = 0.05  # the longest any thread sleeps without re-checking deadlines and closing
_RETRY_SEND_S = 0.01  # how soon a message ZMQ refused (no live peer yet) is offered again


class _Waiter(threading.local):
    """A waiting thread's poll set (the socket's fd and its wake-up pipe), made at its first wait."""

    poller: select.poll | None = None
    wake_r = wake_w = -1


class DepotClient:
    """A connection to one server, shared by every thread of the process that uses it."""

    def __init__(self, url: str | None = None, *, timeout_s: float = 2.0, heartbeat_s: float = 1.0,
                 name: str = "kvdepot", connect: bool = True, log_outages: bool = True,
                 curve_dir: str | None = None) -> None:
        self.url = check_url(url or default_url())
        # tcp:// with server_curve_dir (this argument, else the config): CURVE, as the server wants
        self._curve = client_curve(self.url, curve_dir or (config_curve_dir() if self.url.startswith("tcp://") else None))
        self.timeout_s, self.heartbeat_s, self.name = timeout_s, heartbeat_s, name
        self.session_id, self.server_id = 0, 0
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = self._socket()
        self._fd: int = self._sock.getsockopt(zmq.FD)  # readable when the socket may have news
        self._sock_lock = threading.RLock()  # the socket and _unsent; held for non-blocking calls only
        self._unsent: deque[tuple[int, list[p.Buffer]]] = deque()  # in order, ZMQ could not take yet
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._calls: dict[int, Call] = {}
        self._calls_lock = threading.Lock()  # _calls and _waiters
        self._waiters = 0  # threads in _wait
        self._ids = itertools.count(1)
        self._hooks: list[Callable[[], None]] = []
        self._ready = threading.Event()
        self._retry = threading.Event()
        self._closed = threading.Event()
        self._handshake_lock = threading.Lock()
        self._warn_lock = threading.Lock()
        self._warned = not log_outages  # True: the one warning per outage has been logged
        self._log_outages = log_outages
        self._local = _Waiter()  # per thread that waits: a poll set and a wake-up pipe
        self._pipes: list[int] = []  # every such pipe's fds, closed with the client
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
        """Send now, from this thread. The future's ``result()`` waits for the reply in the thread
        that asks; a future nobody asks about is settled by the I/O thread's next tick."""
        req_id = next(self._ids)
        future = Reply(self, req_id)
        if self._closed.is_set() or not (handshake or self._ready.is_set()):
            future.set_exception(ServerUnavailable(f"kvdepot server {self.url} is not connected"))
            return future
        op = p.OP_OF[type(msg)]
        frames = w.request_frames(op, req_id, msg, payloads)
        timeout = self.timeout_s if timeout is None else timeout
        with self._calls_lock:
            self._calls[req_id] = Call(future, p.OPS[op].reply, time.monotonic() + timeout, timeout)
        with self._sock_lock:
            self._unsent.append((req_id, frames))
            self._pump_locked()
            queued = bool(self._unsent)
        if queued:
            self._wake()  # the I/O thread offers it again until a connection takes it
        return future

    def call(self, msg: msgspec.Struct, payloads: Sequence[p.Buffer] = (), *, timeout: float | None = None,
             handshake: bool = False) -> Result:
        """Send and wait for the reply; ``ServerUnavailable`` or ``ServerError`` on failure."""
        future = self.submit(msg, payloads, timeout=timeout, handshake=handshake)
        wait = (self.timeout_s if timeout is None else timeout) + 1.0  # the call's deadline expires it first
        try:
            return future.result(wait)
        except FutureTimeout:
            raise ServerUnavailable(f"no reply from {self.url} in {wait:.1f} s") from None

    def _wait(self, future: Reply, timeout: float | None) -> float | None:
        """Read the socket in this thread until ``future`` is settled, its deadline passes (it is
        then settled as unavailable), or ``timeout`` runs out; returns what is left of
        ``timeout``. Sleeps outside the lock."""
        if Future.done(future):
            return timeout
        limit = time.monotonic() + timeout if timeout is not None else float("inf")
        local = self._local
        if local.poller is None:  # once per thread: a poll set of the socket's fd and a waker
            local.wake_r, local.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            with self._calls_lock:
                self._pipes += [local.wake_r, local.wake_w]
            local.poller = select.poll()
            local.poller.register(self._fd, select.POLLIN)
            local.poller.register(local.wake_r, select.POLLIN)
        with self._calls_lock:
            self._waiters += 1
        # Set before looking at the future: a thread that settles it from now on writes the pipe.
        # The socket was drained since the request went out, so its fd signals any reply from then.
        future._waker = (threading.get_ident(), local.wake_w)
        try:
            while True:
                now = time.monotonic()
                with self._calls_lock:
                    call = self._calls.get(future._req_id)
                # Settled; being settled by another thread, or the client closing (Future's own
                # wait covers both); or out of time.
                if Future.done(future) or call is None or self._closed.is_set() or now >= limit:
                    return None if timeout is None else max(0.0, limit - now)
                if call.deadline <= now:
                    self._settle(future._req_id, error=self._late(call))
                    return timeout
                pause = min(min(limit, call.deadline) - now, _RETRY_SEND_S if self._unsent else _IDLE_POLL_S)
                with contextlib.suppress(InterruptedError):
                    for fd, _ in local.poller.poll(max(0.0, pause) * 1000):
                        if fd == local.wake_r:
                            with contextlib.suppress(BlockingIOError):
                                os.read(local.wake_r, 64)
                with self._sock_lock:
                    self._pump_locked()
        finally:
            future._waker = None
            with self._calls_lock:
                self._waiters -= 1

    def _drain_now(self) -> None:
        """Settle what has arrived, unless another thread holds the socket (it drains then)."""
        if self._sock_lock.acquire(blocking=False):
            try:
                self._pump_locked()
            finally:
                self._sock_lock.release()

    def _late(self, call: Call) -> ServerUnavailable:
        return ServerUnavailable(f"no reply from {self.url} within {call.timeout:g} s")

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
        waker = call.future._waker
        if waker is not None and waker[0] != threading.get_ident():
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(waker[1], b"\0")

    # ---- the socket (every use under _sock_lock, none of them blocking) ---------------------------
    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.RECONNECT_IVL, 100),
                              (zmq.RECONNECT_IVL_MAX, 1000), (zmq.SNDHWM, 10000), (zmq.RCVHWM, 10000)):
            sock.setsockopt(option, value)
        if self._curve is not None:
            self._curve.secure(sock)
        sock.connect(self.url)
        return sock

    def _pump_locked(self) -> None:
        """Send what waits to be sent, in order, then drain every reply that has arrived.

        With ZMQ_IMMEDIATE a message waits here (until its deadline) for a live connection
        instead of queueing inside ZMQ for a peer that may be dead."""
        sock = self._sock
        if sock is None:
            return
        while self._unsent:
            req_id, frames = self._unsent[0]
            with self._calls_lock:
                live = req_id in self._calls
            if live:
                try:
                    send_frames(sock, frames, 2)  # header, body: copied; payloads: zero-copy
                except zmq.Again:
                    break
            self._unsent.popleft()
        # Until ZMQ_EVENTS (which processes pending commands) shows nothing more to read: from
        # then on the fd signals the next arrival.
        while readable(sock):
            self._deliver(recv_frames(sock, 2))

    def _deliver(self, frames: list[p.Buffer]) -> None:
        try:
            header = w.parse_reply_header(frames[0])
            with self._calls_lock:
                call = self._calls.get(header.req_id)
            if call is None:
                return
            if header.status:
                err = w.decode(frames[1], p.ErrorReply)
                self._settle(header.req_id, error=ServerError(err.code, err.message))  # type: ignore[attr-defined]
            else:
                body = w.decode(frames[1], call.reply)
                self._settle(header.req_id, (body, frames[2:]))  # type: ignore[arg-type]
        except (msgspec.MsgspecError, IndexError) as exc:
            logger.warning("kvdepot: undecodable reply from %s dropped: %s", self.url, exc)

    # ---- the I/O thread: retried sends, replies nobody asked for, deadlines ---------------------
    def _io_loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed.is_set():
            with contextlib.suppress(InterruptedError):
                poller.poll((_RETRY_SEND_S if self._unsent else _IDLE_POLL_S) * 1000)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 1 << 16)
            with self._sock_lock:
                self._pump_locked()  # replies first: one that arrived in time is not expired
            self._expire()
        with self._calls_lock:
            left = list(self._calls)
        for req_id in left:
            self._settle(req_id, error=ServerUnavailable("client closed"))
        deadline = time.monotonic() + 1.0  # waiting threads see their futures settled and leave
        while self._waiters and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._sock_lock:
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close(0)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._calls_lock:
            late = [(req_id, call) for req_id, call in self._calls.items() if call.deadline <= now]
        for req_id, call in late:
            self._settle(req_id, error=self._late(call))

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # ---- health ----------------------------------------------------------------------------------
    def _mark_down(self, reason: str) -> None:
        self._ready.clear()
        self._retry.set()
        with self._warn_lock:  # callers fail on their own threads now: still one warning
            warn, self._warned = not self._warned, True
        if warn:
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
        for fd in (self._wake_r, self._wake_w, *self._pipes):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ctx.term()
