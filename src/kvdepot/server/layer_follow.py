"""The client's side of a load by layer answered early: the forward's wait for each layer.

``cudaStreamWaitEvent`` waits for an event's *latest* record, so the forward must not wait on
layer ``l``'s event before the server has recorded it for this load (``layer_progress``, the
server side). ``RemoteProgress.through(l)`` returns once it has:

    RemoteProgress(ask, ready, layers, timeout_s, watch=, stats=)
      through(l)      returns once layer ``l`` is recorded; ``TransferFailed`` if it never will be
                      (``FencedFailure`` where the server recorded the remaining events after every
                      copy that went: the caller waits on the last one before it gives up)
    Watch(page, load_id, until_ns, alive)   where to read the load's progress without a round trip
    FollowStats                             LAYERS calls and page fallbacks (benchmarks read them)

With a ``Watch`` (the registration's ``progress_page``) the wait reads the page, pausing between
reads (10 us growing to 100 us) while the server has not got there. Where the page cannot tell —
its slot holds a later load's word, the session that registered it is gone (``alive``), or the
server wrote nothing by ``until_ns`` (past the load's deadline a live server has failed it) — the
wait asks LAYERS from then on, one call kept ahead in flight, exactly as without a page: so a
server that died, a deadline, a client that registered again end as they did before the page,
in ``TransferFailed`` from the wait of the first layer not known recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from kvdepot.errors import KVDepotError
from kvdepot.server.progress_page import FAILURES, ProgressPage
from kvdepot.transfer.layered import TransferFailed

WATCH_GRACE_NS = 100_000_000  # a page silent this long past the load's deadline: ask LAYERS
_POLL_MAX_S = 100e-6  # the longest pause between two reads of the page


class FencedFailure(TransferFailed):
    """The load failed, and the server recorded its last layer's event after every copy of it
    that was enqueued: a stream that waits on that event is past all of them."""


Ask = Callable[[int], Future]  # LAYERS(load_id, through) sent; its future gives (LayersReply, payloads)


@dataclass
class FollowStats:
    """What following early-answered loads cost (one per ``RemoteEngine``; benchmarks read it)."""

    loads: int = 0  # loads followed
    asks: int = 0  # LAYERS calls sent
    fallbacks: int = 0  # loads whose page could not tell, followed by LAYERS from then on


@dataclass
class Watch:
    """Where the client reads a load's progress without a round trip: ``page``'s slot of
    ``load_id``, while ``alive()`` (the session that registered the page is still served) and
    until ``until_ns`` (monotonic: past the load's deadline the server has failed it, if alive)."""

    page: ProgressPage
    load_id: int
    until_ns: int
    alive: Callable[[], bool] = lambda: True


class RemoteProgress:
    """The client's knowledge of an early-answered load: ``through(l)`` returns once the server
    has recorded layer ``l``'s event for this load — read from the progress page where there is
    one (``watch``), else asked with LAYERS, one call kept ahead in flight."""

    def __init__(self, ask: Ask, ready: int, layers: int, timeout_s: float, watch: Watch | None = None,
                 stats: FollowStats | None = None) -> None:
        self.ready, self.layers, self.timeout_s = ready, layers, timeout_s
        self.stats = stats or FollowStats()
        self.stats.loads += 1
        self._watch = watch
        self._ask = ask
        self._failed = ""
        self._fenced = False
        self._next: Future | None = self._send(ready) if ready < layers and watch is None else None
        self._lock = threading.Lock()

    def _send(self, through: int) -> Future:
        self.stats.asks += 1
        return self._ask(through)

    def through(self, layer: int) -> None:
        """Return once layer ``layer`` is recorded; ``TransferFailed`` if it never will be."""
        with self._lock:
            while layer >= self.ready:
                if self._failed:
                    kind = FencedFailure if self._fenced else TransferFailed
                    raise kind(f"kvdepot: the server's layered load failed after {self.ready} layers: {self._failed}")
                if self._watch is not None:
                    if self._read_page(layer, self._watch):
                        continue
                    self._watch = None  # the page cannot tell: LAYERS from here on, as without one
                    self.stats.fallbacks += 1
                future, self._next = self._next or self._send(layer), None
                try:
                    reply, _ = future.result(self.timeout_s + 1.0)
                except (KVDepotError, FutureTimeout) as exc:
                    self._failed = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    continue
                if reply.failed:
                    self._failed, self._fenced = reply.failed, reply.fenced
                self.ready = max(self.ready, min(reply.recorded, self.layers))
                if not self._failed and self.ready < self.layers:
                    self._next = self._send(self.ready)  # in flight while the forward runs on

    def _read_page(self, layer: int, watch: Watch) -> bool:
        """Read the page until it says ``layer`` is recorded or the load failed (True), or until
        it cannot tell (False): the slot is a later load's, the session is gone, or the server
        wrote nothing by ``watch.until_ns``. Pauses between reads grow to ``_POLL_MAX_S``."""
        pause = 0.0
        while True:
            seen = watch.page.read(watch.load_id, self.layers)
            if seen is None:
                return False
            self.ready = max(self.ready, seen.recorded)
            if seen.failure:
                self._failed, self._fenced = FAILURES.get(seen.failure, "failed"), seen.fenced
                return True
            if layer < self.ready:
                return True
            if not watch.alive() or time.monotonic_ns() > watch.until_ns:
                return False
            time.sleep(pause)
            pause = min(2 * pause + 10e-6, _POLL_MAX_S)
