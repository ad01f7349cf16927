"""The ZMQ side of the server: one loop thread reads the ROUTER socket; handlers run on a pool.

    DepotServer(url, config, ...).start()    bind, then serve on a background thread
    DepotServer(...).serve_forever()         serve in this thread until SIGINT/SIGTERM
    DepotServer.stop()                       stop serving, close sessions, remove the socket file

The loop reads requests and answers at once those that cannot block (``DepotService.try_inline``:
PING, QUERY_PREFETCH_STATUS, and LOOKUP/RELEASE over host memory when no engine lock is held);
the others go to the thread pool, and the worker that ran one sends its reply itself. At most
``max_pending`` requests wait for the pool; beyond that the server answers BUSY rather than
queueing without bound.

The socket is shared the way the client shares its own: every use is non-blocking and under a
lock; the loop sleeps in ``poll`` on the socket's notification fd (``ZMQ_FD``) and a wake-up
pipe, never on the socket. Any ZMQ operation may consume the fd's readiness, so a worker that
has sent a reply checks ``ZMQ_EVENTS`` and wakes the loop if a request is waiting unread, and
the loop reads until ``ZMQ_EVENTS`` shows nothing (or, after a batch of 256, goes round again
without sleeping). ``serve_forever`` (the ``kvdepot server`` process) freezes the start-up heap
for the garbage collector.

One server per URL: an ipc:// server holds an exclusive lock on ``<socket>.lock`` for its
life (a second one fails at once, naming the first one's pid); a TCP server fails on bind.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from kvdepot.config import DepotConfig, load_config
from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import readable, recv_frames, send_frames
from kvdepot.server.metrics import start_metrics
from kvdepot.server.paths import check_url, default_url, ipc_path
from kvdepot.server.service import DepotService

logger = logging.getLogger("kvdepot")


class ServerAlreadyRunning(KVDepotError):
    """Another server already serves this URL."""


class DepotServer:
    """A kvdepot server: the host tier of every engine that connects, behind one socket."""

    def __init__(
        self, url: str | None = None, config: DepotConfig | None = None, *, workers: int = 4,
        session_timeout_s: float = 30.0, max_frame_bytes: int = 4 << 30, metrics_port: int = 0,
        reap_interval_s: float | None = None, max_pending: int = 1024,
    ) -> None:
        self.url = check_url(url or default_url())
        self.config = config or load_config()
        self.service = DepotService(self.config, url=self.url, session_timeout_s=session_timeout_s,
                                    max_payload_bytes=max_frame_bytes)
        self.workers, self.max_frame_bytes, self.metrics_port = workers, max_frame_bytes, metrics_port
        self.max_pending = max_pending
        self.reap_interval_s = reap_interval_s or max(0.05, min(1.0, session_timeout_s / 4))
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._lock_file: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._sock_lock = threading.Lock()  # the router; held for non-blocking calls only
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._reaping = False
        self._stop_metrics: Any = None

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self) -> DepotServer:
        # Metrics first: a port that cannot be bound refuses the start before the socket exists.
        if self.metrics_port:
            self._stop_metrics = start_metrics(self.service.snapshot, self.metrics_port, self.config.metrics_host)
        try:
            self._bind()
        except BaseException:
            if self._stop_metrics is not None:
                self._stop_metrics()
                self._stop_metrics = None
            raise
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvdepot-handler")
        self._thread = threading.Thread(target=self._loop, name="kvdepot-server", daemon=True)
        self._thread.start()
        logger.info("kvdepot server %d listening on %s (pid %d)", self.service.server_id, self.url, os.getpid())
        return self

    def _bind(self) -> None:
        path = ipc_path(self.url)
        if path is not None:
            self._take_lock(path)
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        try:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # stale: we hold the lock, so no live server uses it
                old_umask = os.umask(0o177)
                try:
                    router.bind(self.url)
                finally:
                    os.umask(old_umask)
                os.chmod(path, 0o600)
            else:
                router.bind(self.url)
        except zmq.ZMQError as exc:
            router.close(0)
            self._release()
            if exc.errno == zmq.EADDRINUSE:
                raise ServerAlreadyRunning(f"{self.url} is already in use (another kvdepot server?); "
                                           "stop it or pass another --url") from None
            raise KVDepotError(f"cannot listen on {self.url}: {exc}") from None
        self._router = router

    def _take_lock(self, path: Any) -> None:
        if not path.parent.is_dir():
            raise KVDepotError(f"directory {path.parent} of {self.url} does not exist")
        lock = open(f"{path}.lock", "a+")  # noqa: SIM115 - held for the server's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "?"
            lock.close()
            raise ServerAlreadyRunning(f"a kvdepot server (pid {owner}) is already serving {self.url}; "
                                       "stop it first, or start this one with another --url") from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock_file = lock

    def _release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the flock
            self._lock_file = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving; every session is closed (leases released, pools unmapped)."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.service.close()
        with self._sock_lock:
            router, self._router = self._router, None
        if router is not None:
            router.close(0)
            path = ipc_path(self.url)
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None
        self._release()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        logger.info("kvdepot server %d stopped", self.service.server_id)

    def serve_forever(self, ready: Any = None) -> None:
        """Serve in the calling (main) thread until SIGINT or SIGTERM, then stop cleanly."""
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            # NOTE: what exists now (torch, the modules: ~200k objects) lives as long as the
            # process; frozen, the collector never walks it again (a full pass costs ~0.1 s).
            gc.freeze()
            if ready is not None:
                ready()
            while not stop.wait(0.2):
                if self._thread is None or not self._thread.is_alive():
                    logger.error("kvdepot server loop ended unexpectedly")
                    break
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def __enter__(self) -> DepotServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the loop: reads every request, answers the cheap ones -------------------------------
    def _loop(self) -> None:
        assert self._router is not None
        poller = select.poll()
        poller.register(self._router.getsockopt(zmq.FD), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        next_reap = time.monotonic() + self.reap_interval_s
        more = False
        while not self._stopping.is_set():
            timeout_ms = 0 if more else max(0, int((next_reap - time.monotonic()) * 1000))
            events: list = []
            with contextlib.suppress(InterruptedError):
                events = poller.poll(timeout_ms)
            if any(fd == self._wake_r for fd, _ in events):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 1 << 16)
            more = self._read_requests()
            if time.monotonic() >= next_reap:
                next_reap = time.monotonic() + self.reap_interval_s
                if not self._reaping:
                    self._reaping = True
                    self._submit(self._reap)

    def _read_requests(self) -> bool:
        """Handle what has arrived; True if it stopped at the batch limit with more waiting."""
        assert self._router is not None
        for _ in range(256):  # then look at stop and upkeep before reading more
            with self._sock_lock:
                # ZMQ_EVENTS processes pending commands: once it shows nothing to read, the fd
                # signals the next request.
                if not readable(self._router):
                    return False
                try:
                    frames = recv_frames(self._router, 3)  # peer, header, body; payloads zero-copy
                except zmq.Again:
                    continue
            peer, body = frames[0], frames[1:]
            try:
                header, spec, msg, payloads = w.parse_request(body)
            except p.ProtocolError as exc:
                self._send(peer, w.error_frames(exc.req_id, exc.code, exc.message), check=False)
                continue
            reply = self.service.try_inline(peer, header.req_id, spec, msg, payloads)
            if reply is not None:
                self._send(peer, reply, check=False)
                continue
            with self._pending_lock:
                busy = self._pending >= self.max_pending
                if not busy:
                    self._pending += 1
            if not busy:
                if self._submit(self._work, peer, header.req_id, spec, msg, payloads):
                    continue
                with self._pending_lock:
                    self._pending -= 1
            self._send(peer, w.error_frames(header.req_id, p.ErrorCode.BUSY, "server busy; retry later"), check=False)
        return True

    def _submit(self, fn: Any, *args: Any) -> bool:
        try:
            assert self._pool is not None
            self._pool.submit(fn, *args)
            return True
        except RuntimeError:  # shutting down
            return False

    def _work(self, peer: bytes, req_id: int, spec: p.OpSpec, msg: Any, payloads: list[p.Buffer]) -> None:
        try:
            frames = self.service.dispatch(peer, req_id, spec, msg, payloads)
        finally:
            with self._pending_lock:
                self._pending -= 1
        if self._send(peer, frames):
            self._wake()  # the send took the fd's signal of a request still unread: the loop reads it

    def _reap(self) -> None:
        try:
            self.service.reap()
        except Exception:  # the server boundary: upkeep must never kill the pool thread
            logger.exception("kvdepot server: session upkeep failed")
        finally:
            self._reaping = False

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _send(self, peer: bytes, frames: list[p.Buffer], check: bool = True) -> bool:
        """Send a reply (dropped if the peer is gone). With ``check`` (not the loop, which reads
        on anyway): True if a request now waits unread."""
        with self._sock_lock:
            router = self._router
            if router is None:
                return False
            try:
                send_frames(router, [peer, *frames], 3)  # peer, header, body: copied; payloads: zero-copy
            except zmq.ZMQError as exc:  # the peer is gone or not reading: its reply is dropped
                logger.debug("kvdepot server: reply to %r dropped: %s", peer, exc)
            return check and readable(router)
