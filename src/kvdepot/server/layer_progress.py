"""A load by layer answered before all its layers are enqueued: the server side.

Why: enqueueing a layer's copies costs the server ~0.5 ms of host time at 1024 blocks (an 8B
model at 32K tokens: ~16 ms for 32 layers). Recorded in full before the reply, that time sat
in front of the client's forward (server-mode TTFT 24% above in-process at 32K). Now the server
replies and its ``LayerIssuer`` thread enqueues and records every layer while the client's
forward runs (``start_early``; layer 0 before the reply only where the client has no progress
page to learn of it from).

The one hazard: ``cudaStreamWaitEvent`` waits for an event's *latest* record. A wait enqueued
before the server recorded layer ``l`` for this load would wait for the previous load's record
(long passed) and let attention read blocks still being filled. So the client never waits on
layer ``l`` before the server said layer ``l`` is recorded:

Server side
    LayerProgress(load_id, layers)  how many events are recorded; ``fail`` ends it short
    LoadBook                        a session's recent loads by id (LAYERS looks them up)
    LayerIssuer                     one shard's thread: jobs in order, so two loads' records of
                                    one event never interleave (later loads wait in its queue)
    record_rest(...)                the job: per layer, deadline check, enqueue (the load records
                                    the layer's event on its copy stream), advance
Client side: ``layer_follow`` (``RemoteProgress``: the forward's wait, reading the server's
progress page or asking LAYERS).

Failure mid-way (a layer's copies not enqueued, the deadline passed, the server dying) therefore
reaches the client as ``TransferFailed`` from the wait of the first layer not recorded — before
its attention could read it — exactly as an in-process layered load reports a failed enqueue.
The server publishes to the page under the progress's lock, after the events it counts are
recorded and before LAYERS could report them (``progress_page``: why the client's read is safe).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvdepot.errors import KVDepotError
from kvdepot.server.progress_page import ProgressPage
from kvdepot.transfer.layered import LayerIssuer, LayerWaits, TransferFailed

logger = logging.getLogger("kvdepot")

MAX_LOADS = 64  # a session's loads kept for LAYERS: loads are ordered per shard, older ones are done
MAX_WAIT_S = 1.0  # a LAYERS wait on the server answers with what it has after this long


class DeadlinePassed(KVDepotError):
    """The client's deadline passed before a layer could be enqueued."""


# ---- server side ---------------------------------------------------------------------------------
class LayerProgress:
    """Layers ``0..recorded-1`` of one load have their events recorded; thread-safe. With a
    ``page`` (the registration's ``progress_page``) every change is also written there."""

    def __init__(self, load_id: int, layers: int, deadline_ns: int = 0, page: ProgressPage | None = None) -> None:
        self.load_id, self.layers, self.deadline_ns = load_id, layers, deadline_ns
        self.recorded = 0
        self.failed = ""
        self.fenced = False  # failed, and the rest of the events recorded after every enqueued copy
        self._page = page
        self._cond = threading.Condition()

    @property
    def paged(self) -> bool:
        """The client learns of this load's layers from a progress page (no LAYERS round trip)."""
        return self._page is not None

    @property
    def done(self) -> bool:
        return self.recorded >= self.layers or bool(self.failed)

    def advance(self, recorded: int) -> None:
        """Layers ``0..recorded-1`` are recorded (call once ``cudaEventRecord`` has returned)."""
        with self._cond:  # NOTE: the page is written under the lock: see progress_page, why a read is safe
            self.recorded = max(self.recorded, recorded)
            if self._page is not None:
                self._page.write(self.load_id, self.recorded)
            self._cond.notify_all()

    def fail(self, reason: str, fenced: bool = False, failure: int = 3) -> None:
        """No layer from ``recorded`` on will be; ``failure``: its ``progress_page.FAILURES`` kind."""
        with self._cond:
            self.failed, self.fenced = reason or "failed", fenced
            if self._page is not None:
                self._page.write(self.load_id, self.recorded, failure, fenced)
            self._cond.notify_all()

    def past(self, layer: int) -> bool:
        return self.recorded > layer or self.done

    def wait_past(self, layer: int, timeout_s: float = MAX_WAIT_S) -> tuple[int, str, bool]:
        """(recorded, failed, fenced) once layer ``layer`` is recorded or the load ended, or after
        ``timeout_s`` (at most till just past the load's deadline: the issuer fails it then)."""
        if self.deadline_ns:
            timeout_s = min(timeout_s, max(0.0, (self.deadline_ns - time.monotonic_ns()) / 1e9) + 0.05)
        with self._cond:
            self._cond.wait_for(lambda: self.past(layer), timeout=timeout_s)
            return self.recorded, self.failed, self.fenced


class LoadBook:
    """Every session's recent early-answered loads, by (session id, load id)."""

    def __init__(self) -> None:
        self._loads: dict[int, OrderedDict[int, LayerProgress]] = {}
        self._lock = threading.Lock()

    def add(self, sid: int, progress: LayerProgress) -> None:
        with self._lock:
            loads = self._loads.setdefault(sid, OrderedDict())
            loads[progress.load_id] = progress
            while len(loads) > MAX_LOADS and next(iter(loads.values())).done:
                loads.popitem(last=False)

    def get(self, sid: int, load_id: int) -> LayerProgress | None:
        with self._lock:
            return self._loads.get(sid, {}).get(load_id)

    def drop(self, sid: int) -> None:
        with self._lock:
            self._loads.pop(sid, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._loads.values())


def record_rest(load: LayerWaits, progress: LayerProgress, record: Callable[[int], None], stream: object) -> None:
    """Enqueue layers ``progress.recorded..`` of ``load`` in order: per layer, refuse past the
    deadline, enqueue the layer (the load records its interprocess event on its copy stream right
    after the layer's copies: ``LayeredLoad``'s ``on_layer``) and advance. On any failure ``load``
    is abandoned (no further copies), the remaining events are ``record``ed on ``stream`` after
    every copy that did go (the fence), and ``progress`` failed: the client's wait for that layer
    raises, after waiting on the fence.

    Why the copy stream and not a stream of the pool's own made to wait for each layer: that
    waiting stream kept the server's context in the GPU's time-slice rotation for as long as the
    copies ran, and the client's forward lost ~0.3 ms a layer to it (issue 19, seventh and eighth
    passes in docs/perf-notes.md: MP TTFT 1.15x in-process at 16K and 32K, 1.02x without it)."""
    try:
        for layer in range(progress.recorded, progress.layers):
            if progress.deadline_ns and time.monotonic_ns() > progress.deadline_ns:
                raise DeadlinePassed(f"the client's deadline passed before layer {layer} was enqueued")
            load.enqueue_through(layer)
            progress.advance(layer + 1)
            time.sleep(0)  # let the loop thread answer the LAYERS waiting for this layer
    except Exception as exc:
        load.abandon(exc)
        fenced = _fence(load, progress, record, stream)
        failure = 1 if isinstance(exc, TransferFailed) else 2 if isinstance(exc, DeadlinePassed) else 3
        progress.fail(f"{type(exc).__name__}: {exc}", fenced, failure)
        if not isinstance(exc, (TransferFailed, DeadlinePassed)):
            logger.error("kvdepot server: layer %d of a load could not be signalled: %s", progress.recorded, exc)


def _fence(load: LayerWaits, progress: LayerProgress, record: Callable[[int], None], stream: object) -> bool:
    """Record layers ``recorded..`` after every copy of ``load`` enqueued so far; False if that
    failed too (a broken device: the client then learns of the failure without a fence)."""
    try:
        load.wait_enqueued(stream)
        for layer in range(progress.recorded, progress.layers):
            record(layer)
    except Exception as exc:
        logger.error("kvdepot server: a failed load's fence could not be recorded: %s", exc)
        return False
    return True


def start_early(load: LayerWaits, progress: LayerProgress, issuer: LayerIssuer, record: Callable[[int], None],
                stream: object, on_end: Callable[[], None],
                context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
    """Answer ``load`` early (call under the shard's lock, so ``issuer.idle`` stays true): where
    ``progress`` has no page, layer 0 is recorded now if no earlier load's layers wait in
    ``issuer`` (else it too is left to the issuer, behind them); the rest are queued. ``on_end``
    runs once the job ends, however it ends. A failure to record layer 0 here raises, and nothing
    is queued (``on_end`` is the caller's).

    With a page (``progress.paged``) every layer is left to the issuer. The copies start as early
    either way, and the reply no longer waits for layer 0's enqueue: the client's forward learns
    of layer 0 from the page, for free. Without a page it would ask LAYERS, a round trip, before
    its first layer."""
    if not progress.paged and issuer.idle:
        try:
            load.enqueue_through(0)
        except BaseException as exc:
            load.abandon(exc)
            raise
        progress.advance(1)

    def job() -> None:
        try:
            with context():  # the pool's device, on the issuer's thread
                record_rest(load, progress, record, stream)
        finally:
            on_end()

    issuer.submit(job)

