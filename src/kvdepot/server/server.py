"""The ZMQ side of the server: one loop thread reads the ROUTER socket; handlers run on a pool.

    DepotServer(url, config, ...).start()    bind, then serve on a background thread
    DepotServer(...).serve_forever()         serve in this thread until SIGINT/SIGTERM
    DepotServer.stop()                       stop serving, close sessions, remove the socket file

The loop reads requests, refuses a body longer than its op's bound (``protocol.OPS``) without
decoding it, and answers at once what the op's mode lets run there and can finish now
(``DepotService.try_inline``: INLINE ops, and TRY_INLINE ones whose handler does not raise
``WouldBlock``); it decodes only bodies within the op's ``inline_body``. The others go to the
thread pool — decoded there — and the worker that ran one sends its reply itself. At most
``max_pending`` requests wait for the pool; beyond that the server answers BUSY rather than
queueing without bound. A request that fails on the loop in any way gets an INTERNAL reply; if
the loop thread dies all the same, ``serve_forever`` raises ``ServerFailed`` (the process exits
non-zero).

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
from pathlib import Path
from typing import Any

import zmq

from kvdepot.config import DepotConfig, load_config
from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.auth import server_curve
from kvdepot.server.client import readable, recv_frames, send_frames
from kvdepot.server.metrics import start_metrics
from kvdepot.server.paths import check_socket, check_url, default_url, ipc_path, open_private
from kvdepot.server.service import DepotService

logger = logging.getLogger("kvdepot")


class ServerAlreadyRunning(KVDepotError):
    """Another server already serves this URL."""


class ServerFailed(KVDepotError):
    """The server stopped serving on its own (its loop thread died)."""


class DepotServer:
    """A kvdepot server: the host tier of every engine that connects, behind one socket."""

    def __init__(
        self, url: str | None = None, config: DepotConfig | None = None, *, workers: int = 4,
        session_timeout_s: float = 30.0, max_frame_bytes: int = 4 << 30, metrics_port: int = 0,
        reap_interval_s: float | None = None, max_pending: int = 1024, insecure: bool = False,
    ) -> None:
        self.url = check_url(url or default_url())
        self.config = config or load_config()
        # tcp:// needs CURVE keys (server_curve_dir) unless ``insecure``: refused here, before anything starts
        self._curve = server_curve(self.url, self.config.server_curve_dir, insecure=insecure)
        self._stop_auth: Any = None
        self.service = DepotService(self.config, url=self.url, session_timeout_s=session_timeout_s,
                                    max_payload_bytes=max_frame_bytes)
        self.workers, self.max_frame_bytes, self.metrics_port = workers, max_frame_bytes, metrics_port
        self.max_pending = max_pending
        self.reap_interval_s = reap_interval_s or max(0.05, min(1.0, session_timeout_s / 4))
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._lock_file: int | None = None  # fd of <socket>.lock, flocked
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._sock_lock = threading.Lock()  # the router; held for non-blocking calls only
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._reaping = False
        self._stop_metrics: Any = None
        self._failure = ""  # why the loop thread died, if it did

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self) -> DepotServer:
        if self.metrics_port:  # first: a taken port fails before anything else is held
            try:
                self._stop_metrics = start_metrics(self.service.snapshot, self.metrics_port, self.config.metrics_host)
            except OSError as exc:
                raise KVDepotError(f"cannot serve metrics on port {self.metrics_port} (--metrics-port): "
                                   f"{exc.strerror or exc}") from None
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
        if self._curve is not None:
            self._stop_auth = self._curve.secure(self._ctx, router)
        try:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # stale: we hold the lock, so no live server uses it
                old_umask = os.umask(0o177)  # the socket is born 0600: no chmod (which follows symlinks)
                try:
                    router.bind(self.url)
                finally:
                    os.umask(old_umask)
                check_socket(path)
            else:
                router.bind(self.url)
        except zmq.ZMQError as exc:
            router.close(0)
            self._release()
            if exc.errno == zmq.EADDRINUSE:
                raise ServerAlreadyRunning(f"{self.url} is already in use (another kvdepot server?); "
                                           "stop it or pass another --url") from None
            raise KVDepotError(f"cannot listen on {self.url}: {exc}") from None
        except KVDepotError:  # the bound socket is not private: never serve on it
            router.close(0)
            self._release()
            raise
        self._router = router

    def _take_lock(self, path: Any) -> None:
        if not path.parent.is_dir():
            raise KVDepotError(f"directory {path.parent} of {self.url} does not exist")
        fd = open_private(Path(f"{path}.lock"))  # never through a symlink: the pid overwrites it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ServerAlreadyRunning(f"a kvdepot server (pid {owner}) is already serving {self.url}; "
                                       "stop it first, or start this one with another --url") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_file = fd

    def _release(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # closing drops the flock
            self._lock_file = None
        if self._stop_auth is not None:
            self._stop_auth()
            self._stop_auth = None
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
                    # Not a clean stop: the caller (``kvdepot server``) must exit non-zero, so a
                    # supervisor restarts the server rather than take it for a normal shutdown.
                    raise ServerFailed(f"the server's loop thread died ({self._failure or 'no error recorded'})")
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
        try:
            self._serve()
        except BaseException as exc:  # the loop's boundary: record why, so serve_forever fails loudly
            self._failure = f"{type(exc).__name__}: {exc}"
            logger.critical("kvdepot server: the loop thread died", exc_info=True)

    def _serve(self) -> None:
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
                self._take(peer, body)
            except Exception as exc:  # a per-request failure of any kind (MemoryError too): answer it
                logger.exception("kvdepot server: a request from %r failed on the loop thread", peer)
                self._send(peer, w.error_frames(0, p.ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}"),
                           check=False)
        return True

    def _take(self, peer: bytes, body: list[p.Buffer]) -> None:
        """One request: sizes checked, then answered here if its op's mode allows and it can
        finish now, else handed to the pool (a body over its op's ``inline_body`` is decoded there)."""
        try:
            header, spec = w.parse_header(body)
            msg = None
            if spec.mode is not p.Exec.POOL and len(body[1]) <= spec.inline_body:
                msg = w.decode_body(header, spec, body[1])
                reply = self.service.try_inline(peer, header.req_id, spec, msg, body[2:])
                if reply is not None:
                    self._send(peer, reply, check=False)
                    return
        except p.ProtocolError as exc:
            self._send(peer, w.error_frames(exc.req_id, exc.code, exc.message), check=False)
            return
        with self._pending_lock:
            busy = self._pending >= self.max_pending
            if not busy:
                self._pending += 1
        if not busy:
            if self._submit(self._work, peer, header.req_id, spec, msg, body[1], body[2:]):
                return
            with self._pending_lock:
                self._pending -= 1
        self._send(peer, w.error_frames(header.req_id, p.ErrorCode.BUSY, "server busy; retry later"), check=False)

    def _submit(self, fn: Any, *args: Any) -> bool:
        try:
            assert self._pool is not None
            self._pool.submit(fn, *args)
            return True
        except RuntimeError:  # shutting down
            return False

    def _work(self, peer: bytes, req_id: int, spec: p.OpSpec, msg: Any, body: p.Buffer,
              payloads: list[p.Buffer]) -> None:
        try:
            if msg is None:  # not decoded yet: a POOL op, or a body too large for the loop thread
                frames = self.service.decode_and_dispatch(peer, req_id, spec, body, payloads)
            else:
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
