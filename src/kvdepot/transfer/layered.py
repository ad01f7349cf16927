"""A load enqueued layer by layer, ahead of the forward that reads it.

``CacheEngine.retrieve_by_layer`` answers a ``LayeredLoad``; TensorRT-LLM's worker calls
``wait_layer(l, stream)`` from ``wait_for_layer_load`` before layer ``l``'s attention. Layer ``l``
of every loaded block is in the pool once ``events[l]`` has passed.

Why lazily: enqueueing a layer's copies is one driver call with one copy per block, ~0.5 ms of
host time for 1024 blocks (H200 host, run Q). Enqueued all at once in ``start_load_kv``, a 32K
prompt of an 8B model spent ~16 ms there before the forward could even be issued (run Q: the full
hit by layer sat 18 ms above the same forward with the KV already on the device). Here the first
``LAYERS_AHEAD`` layers are enqueued at once, and each ``wait_layer(l)`` enqueues through layer
``l + LAYERS_AHEAD``: the driver calls are spread over the forward's own issue, and the copy
engine still has the next layers queued while the forward runs.

In-process the rest go on a helper thread (``LayerIssuer``, ``issue_rest``) as well: the driver
calls release the GIL, so the forward's thread no longer spends them between its layers. That
time counted wherever the host paces the forward (issue 19, twelfth pass: ``hooks ms`` 6.6, 19
and 30 ms of a 4K, 16K and 32K hit on an H100 host, 1-2 ms in server mode, whose server
issues them). The forward issues a layer itself only where the helper has not reached it yet.

Never silently wrong: a stream is made to wait for layer ``l`` only after ``events[l]`` has been
recorded (waiting for an event never recorded passes at once), and a failed enqueue raises
``TransferFailed`` from every later wait — after making the waiting stream wait for the copies
that were enqueued, so none lands in a block after the forward gave it up.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvdepot.errors import KVDepotError

LAYERS_AHEAD = 4
logger = logging.getLogger("kvdepot")


class TransferFailed(KVDepotError):
    """A load's copies could not all be enqueued: the blocks it was to fill hold no valid KV."""


class LayerWaits:
    """A load the forward waits for layer by layer, and whether it did so for every layer in order.

    The caller's stream was *not* made to wait for the load: it must wait for each layer before
    that layer's attention reads it (``wait_layer``) and for all of it before anything else uses
    the blocks (``wait_all``). Layers are copied in order on one stream, so the last layer being
    in means the whole load is. Kinds: ``LayeredLoad`` (in-process) and the MP server's
    (``server/ipc.py``, interprocess events the server recorded)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.waited = 0  # layers 0..waited-1 have been waited for by some stream

    def wait_layer(self, layer: int, stream: Any) -> None:
        """Make ``stream`` wait until layer ``layer`` of every loaded block is in the pool."""
        if not 0 <= layer < self.num_layers:
            return  # a layer outside this pool (e.g. a draft model's): nothing of it is loaded here
        self._wait(layer, stream)
        if layer == self.waited:
            self.waited += 1

    def wait_all(self, stream: Any) -> None:
        self._wait(self.num_layers - 1, stream)
        self.waited = self.num_layers

    @property
    def fully_waited(self) -> bool:
        """Every layer was waited for, in order: nothing read a layer before its copies ended."""
        return self.waited == self.num_layers

    def abandon(self, reason: BaseException) -> None:
        """Enqueue nothing more of this load (its waiter has given up: a copy now could race the
        blocks' next owner); later waits raise ``TransferFailed``. No-op where all is enqueued."""

    def wait_enqueued(self, stream: Any) -> None:
        """Make ``stream`` wait for every copy of this load enqueued so far: after a failure, the
        copies that did go must not land in blocks already handed to their next owner."""

    def enqueue_through(self, layer: int) -> None:
        """Enqueue layers ``0..layer`` if they are not yet, making no stream wait: for a load whose
        layers are signalled as they are enqueued (``LayeredLoad``'s ``on_layer``); raises
        ``TransferFailed`` as ``wait_layer`` would. No-op where nothing is enqueued lazily."""

    def _wait(self, layer: int, stream: Any) -> None:
        raise NotImplementedError


class LayeredLoad(LayerWaits):
    """Layer ``l`` readable once ``events[l]`` has passed; copies enqueued lazily on ``side``."""

    def __init__(self, layers: Iterator[int], events: list[Any], side: Any,
                 on_issued: Callable[[BaseException | None], None], ahead: int = LAYERS_AHEAD,
                 on_layer: Callable[[int, Any], None] | None = None,
                 use: Callable[[Any], contextlib.AbstractContextManager[Any]] = torch.cuda.stream) -> None:
        """``layers``: each ``next()`` enqueues the next layer on the current stream (the mover's
        ``scatter_layers``). ``on_issued(None)`` once every layer is enqueued, ``on_issued(error)``
        if one could not be. ``ahead``: layers enqueued past the one waited for (config
        ``load_layers_ahead``). ``on_layer(layer, side)``: called right after each layer's copies
        and event are enqueued on ``side``, to enqueue more there (a server's interprocess event
        for the layer, ``server/layer_progress.py``); raising fails the load there. ``use(side)``:
        makes ``side`` the current stream (``StreamKit.use``), for the first layer's ``next()``,
        which fixes the mover's stream, and for a mover that falls back to torch's copies."""
        super().__init__(len(events))
        self.ahead = ahead
        self.events = events
        self.issued = 0  # layers 0..issued-1 are enqueued and their events recorded
        self._layers, self._side, self._on_issued, self._on_layer = layers, side, on_issued, on_layer
        self._use = use
        self.helped = False  # a helper thread enqueues the layers not yet enqueued (``issue_rest``)
        self._failed: BaseException | None = None
        self._lock = threading.Lock()  # the forward's thread, a helper and a ``wait_all`` elsewhere may all issue

    def issue_through(self, count: int) -> None:
        """Enqueue every layer below ``count`` not enqueued yet."""
        if self._failed is None and self.issued >= min(count, len(self.events)):
            return  # nothing to enqueue (``issued`` only grows): no stream to make current
        self._on_side(lambda: self._issue_through(count))

    def _on_side(self, issue: Callable[[], None]) -> None:
        """``issue()`` with the side stream current on this thread. Failing to make it so fails
        the load, as a failed enqueue does (``on_issued(error)``, ``TransferFailed`` from every
        later wait): the stream context is entered outside ``_issue_through``'s own handling."""
        with contextlib.ExitStack() as scope:
            try:
                scope.enter_context(self._use(self._side))
            except BaseException as exc:
                with self._lock:
                    if self._failed is None and self.issued < len(self.events):
                        raise self._fail(exc) from exc
                    if self._failed is not None:
                        raise self._failure() from self._failed
                return  # every layer was enqueued meanwhile: nothing needed the stream
            issue()

    def _issue_through(self, count: int) -> None:
        """``issue_through`` with the side stream already current on this thread. Each event is
        recorded on the side stream by name: torch's ``record()`` with no stream looks up the
        current one, a few µs of the helper's GIL per layer (issue 19, thirteenth pass: the
        helper's own Python is what the layer thread costs a forward)."""
        with self._lock:
            if self._failed is not None:
                raise self._failure() from self._failed
            count = min(count, len(self.events))
            if self.issued >= count:
                return
            try:
                while self.issued < count:
                    if next(self._layers) != self.issued:
                        raise RuntimeError(f"a mover enqueued layers out of order (expected {self.issued})")
                    self.events[self.issued].record(self._side)
                    if self._on_layer is not None:
                        self._on_layer(self.issued, self._side)
                    self.issued += 1
            except BaseException as exc:
                raise self._fail(exc) from exc
            if self.issued == len(self.events):
                self._on_issued(None)

    def _failure(self, exc: BaseException | None = None) -> TransferFailed:
        return TransferFailed(f"kvdepot: a layered load failed after {self.issued} layers" + (f": {exc}" if exc is not None else ""))

    def _fail(self, exc: BaseException) -> TransferFailed:
        """Enqueue nothing more, tell ``on_issued``; the error for the caller to raise (lock held)."""
        self._failed = exc
        self._layers = iter(())
        self._on_issued(exc)
        return self._failure(exc)

    def issue_rest(self) -> None:
        """Enqueue every layer not enqueued yet, one per hold of the lock, so that a forward that
        needs a layer the helper has not reached takes its turn in between: a helper thread's job
        (set ``helped`` when it is handed over). A failure goes to ``on_issued`` and to the waits.
        The side stream is made current once for the whole job (the current stream is per
        thread), not once per layer as the forward's own ``issue_through`` does."""
        with contextlib.suppress(TransferFailed):
            self._on_side(self._issue_each)

    def _issue_each(self) -> None:
        while self.issued < len(self.events):
            self._issue_through(self.issued + 1)

    def _wait(self, layer: int, stream: Any) -> None:
        # ``issued`` only grows, each layer's event recorded before it counts the layer: past
        # ``layer``, the event is there to wait for. With a helper ahead, the forward neither
        # takes the lock (the helper holds it through a layer's driver call) nor issues.
        if self.helped and self.issued > layer and self._failed is None:
            stream.wait_event(self.events[layer])
            return
        try:
            self.issue_through(layer + 1 + self.ahead)
        except TransferFailed:
            self.wait_enqueued(stream)  # the forward stops here; what did go lands before its next use
            raise
        stream.wait_event(self.events[layer])

    def wait_enqueued(self, stream: Any) -> None:
        stream.wait_stream(self._side)

    def enqueue_through(self, layer: int) -> None:
        self.issue_through(layer + 1)

    def abandon(self, reason: BaseException) -> None:
        with self._lock:
            if self._failed is not None or self.issued == len(self.events):
                return
            self._fail(reason)  # unpinned once what was enqueued has run

    def finish(self) -> None:
        """Enqueue every remaining layer (nothing waits): shutdown, or a forward that stopped early."""
        with contextlib.suppress(TransferFailed):  # handed to ``on_issued``; a waiter hears of it
            self.issue_through(len(self.events))

    @property
    def fully_issued(self) -> bool:
        return self.issued == len(self.events) or self._failed is not None


class LayerIssuer:
    """One thread that runs jobs in order (started at the first job, stopped by ``close``): an
    engine's loads by layer (``issue_rest``), a server shard's early-answered loads
    (``server/layer_progress.py``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._pending = 0  # jobs submitted and not finished
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        """No job queued or running (a caller that submits under its own lock can trust it)."""
        with self._lock:
            return self._pending == 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def drain(self, timeout_s: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # the issuer's boundary: a job reports its own failure
                logger.exception("kvdepot: a layer job failed")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
