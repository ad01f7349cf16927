"""The ZMQ side of the server: one loop thread owns the ROUTER socket; handlers run on a pool.

    DepotServer(url, config, ...).start()    bind, then serve on a background thread
    DepotServer(...).serve_forever()         serve in this thread until SIGINT/SIGTERM
    DepotServer.stop()                       stop serving, close sessions, remove the socket file

The loop reads requests, runs the operations declared ``inline`` itself (cheap, never blocking:
PING, QUERY_PREFETCH_STATUS) and hands the others to the thread pool. Workers put their reply
frames on a queue and write a byte to a pipe the loop polls next to the socket, so only the
loop thread ever touches the socket. At most ``max_pending`` requests wait for the pool; beyond
that the server answers BUSY rather than queueing without bound.

One server per URL: an ipc:// server holds an exclusive lock on ``<socket>.lock`` for its
life (a second one fails at once, naming the first one's pid); a TCP server fails on bind.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
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
        self._replies: queue.SimpleQueue[tuple[bytes, list[p.Buffer]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._reaping = False
        self._stop_metrics: Any = None

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self) -> DepotServer:
        self._bind()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvdepot-handler")
        if self.metrics_port:
            self._stop_metrics = start_metrics(self.service.snapshot, self.metrics_port)
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
        if self._router is not None:
            self._router.close(0)
            self._router = None
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

    # ---- the loop (the only thread that touches the socket) -----------------------------------
    def _loop(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_reap = time.monotonic() + self.reap_interval_s
        while not self._stopping.is_set():
            timeout_ms = max(0, int((next_reap - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self._router in events:
                self._read_requests()
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 1 << 16)
            self._flush_replies()
            if time.monotonic() >= next_reap:
                next_reap = time.monotonic() + self.reap_interval_s
                if not self._reaping:
                    self._reaping = True
                    self._submit(self._reap)

    def _read_requests(self) -> None:
        assert self._router is not None
        for _ in range(256):  # then flush replies before reading more
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes
            body = [f.buffer for f in frames[1:]]
            try:
                header, spec, msg, payloads = w.parse_request(body)
            except p.ProtocolError as exc:
                self._send(peer, w.error_frames(exc.req_id, exc.code, exc.message))
                continue
            if spec.inline:
                self._send(peer, self.service.dispatch(peer, header.req_id, spec, msg, payloads))
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
            self._send(peer, w.error_frames(header.req_id, p.ErrorCode.BUSY, "server busy; retry later"))

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
        self._replies.put((peer, frames))
        self._wake()

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

    def _flush_replies(self) -> None:
        while True:
            try:
                peer, frames = self._replies.get_nowait()
            except queue.Empty:
                return
            self._send(peer, frames)

    def _send(self, peer: bytes, frames: list[p.Buffer]) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([peer, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the peer is gone or not reading: its reply is dropped
            logger.debug("kvdepot server: reply to %r dropped: %s", peer, exc)
