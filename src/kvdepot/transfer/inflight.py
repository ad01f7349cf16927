"""Copies in flight on CUDA side streams, completed in order by polling their events.

    open_store(stream, lead, on_fail) -> StoreStart          order a store's stream, enqueue its lead (CUDA)
    store(start, move, on_done) -> token | None             run the rest now (CPU) or issue it (CUDA)
    abandon(start)                                          a store opened and not carried on
    load(copy, on_done, stream) -> token | None             run now (CPU) or enqueue (CUDA)
    start_layered(layers, num_layers, on_done, stream) -> LayeredLoad   a CUDA load, layer by layer
    poll_locked() / poll()        run ``on_done`` of every transfer whose copy has finished
    is_complete(token) / wait_for(token) / wait_all() / close()

``on_done`` (commit a store's slots, unpin a load's) runs under the owner's lock: the tracker
holds no lock of its own but is given the lock that guards what its callbacks touch (the
engine's, which guards the host tier). ``poll_locked`` expects it held; the others take it.

A CUDA *store* is issued by one background thread (in order): the caller's stream gets an event
at ``store`` and the issuer makes the store's stream wait for it, so the store still reads exactly
what the caller's stream wrote before the call. Issuing a store's copies is host work of ~3.5 ms
per GiB (the retired ``tools/transfer_anatomy.py``, perf-notes run J; H200 host); done by the caller, it kept the engine's step
loop busy and held back a load issued right after it (the next step's), which started its copies
only once the store's were all issued. But a thread that sleeps takes time to wake (H200, run R:
~0.3 ms from the call's return to the issuer's first step), time in which the copy engines sat
idle: so when the issuer is idle, the caller makes the store's stream wait for its own, enqueues
the store's first copies itself (``Move.head``, ``head_bytes``: ~14 MiB in three driver calls by
default, a quarter of a millisecond of copying at PCIe speed) and only then hands the store over,
which wakes the issuer while the copy engines work on the head; the step loop spends the copy
list and those few calls on it. A busy issuer gets the store whole (its stream is busy anyway).
Whoever waits for a store issues what the issuer has not started (``wait_for`` / ``wait_all``): a
thread that waits gains nothing from a wake-up it would sit through, and the server waits for every
store before its reply (the client may then reuse the blocks), as does ``bench transfer``'s row
(H200, run AN: the copy engines idle 150-160 us at a 256 KiB-block store's hand-off). Stores are
issued one at a time, in order, by whichever thread holds ``_issuing``, so a stream's event still
covers every store before it.
A *load* is issued by the caller: its caller's stream must wait for it, and that wait has to be
enqueued before ``load`` returns. A *layered* load is issued by whoever waits on it, a few layers
at a time (``layered.py``); ``wait_for`` / ``wait_all`` enqueue what is left of any, so that
nothing waits for copies nobody will enqueue.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdepot.transfer.base import Move
from kvdepot.transfer.layered import LAYERS_AHEAD, LayeredLoad, LayerIssuer
from kvdepot.transfer.streams import CUDA, StreamKit

logger = logging.getLogger("kvdepot")


class _Flag:
    """A one-shot "done" flag (``set`` / ``is_set`` / ``wait``): a lock held from birth that ``set``
    releases. A ``threading.Event`` is a Python Condition over a lock: ~2 us to make in a hot
    loop and several times that as a GPU host's operation starts (issue 19), once per store."""

    __slots__ = ("_held",)

    def __init__(self, done: bool = False) -> None:
        self._held = threading.Lock()
        if not done:
            self._held.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # set already
            self._held.release()

    def is_set(self) -> bool:
        return not self._held.locked()

    def wait(self) -> None:
        if self._held.locked():  # a set flag is never taken: ``is_set`` stays true for others
            self._held.acquire()
            self.set()


_ISSUED = _Flag(done=True)  # the ``issued`` of every transfer tracked only once enqueued (loads)


@dataclass
class _Queued:
    """A store handed over: its transfer, what is left to enqueue, its stream, and the event on
    the caller's stream it must follow (None: the caller already made the stream wait)."""

    transfer: _Transfer
    moves: tuple[Move, ...]
    side: Any
    ready: Any


@dataclass
class StoreStart:
    """A store between ``open_store`` and ``store``: its streams (None on CPU), whether the caller
    enqueues its head (the issuer was idle), its lead, and whether any of the lead was enqueued."""

    caller: Any
    side: Any
    head: bool
    lead: Move | None
    on_fail: Callable[[], None]
    started: bool = False


@dataclass
class _Transfer:
    """One enqueued copy: finished once issued and its event has passed (or its issue failed)."""

    token: int
    on_done: Callable[[], None]
    on_fail: Callable[[], None]  # runs instead of on_done when the copies could not be enqueued
    event: Any = None  # recorded after the copies; None until then, and after a failed issue
    issued: _Flag = field(default_factory=_Flag)
    failed: bool = False
    passed: bool = False  # a waiter saw the event pass: no need to ask the driver again

    def finished(self) -> bool:
        return self.issued.is_set() and (self.passed or self.event is None or self.event.query())

    def complete(self) -> None:
        (self.on_fail if self.failed else self.on_done)()

    def synchronize(self) -> None:
        """Block until the copies ran. Between the last copy and the waiter's return nothing of
        ours should stand but the commit (issue 19): the poll after this skips a second query."""
        self.issued.wait()
        if self.event is not None:
            self.event.synchronize()
        self.passed = True


class InflightTransfers:
    """The engine's side streams, its store issuer and its FIFO of transfers, oldest first."""

    def __init__(self, lock: AbstractContextManager[Any], layers_ahead: int = LAYERS_AHEAD,
                 kit: StreamKit = CUDA, head_bytes: int = 0, layer_thread: bool = True) -> None:
        self._lock = lock  # the owner's: guards the FIFO and what the callbacks touch
        self.layers_ahead = layers_ahead  # config load_layers_ahead
        # Layered loads' later layers enqueued by a helper thread, not by the forward's waits
        # (``layered.py``); False: by the waits alone (config ``load_layer_thread``).
        self.layer_thread = layer_thread
        self._layer_issuer: LayerIssuer | None = None
        self.kit = kit  # streams and events: CUDA's, or a CPU bench's or test's (``streams.py``)
        self.head_bytes = head_bytes  # config store_head_mib: what a caller may enqueue of a store
        self.streams: tuple[Any, ...] | None = None  # None: CPU pool, copies run inline
        self.inflight: deque[_Transfer] = deque()
        self._tokens = itertools.count(1)
        self._wake: queue.SimpleQueue[bool | None] = queue.SimpleQueue()  # one per store handed over; None: stop
        self._issuer: threading.Thread | None = None
        # Lock order: the owner's lock, then ``_issuing``, then ``_handoff``; the issuer takes
        # neither of the first two while it issues, so a waiter holding the owner's lock can issue.
        self._issuing = threading.Lock()  # held by the one thread issuing handed-over stores
        self._handoff = threading.Lock()  # guards ``_pending`` and ``_queued``; nothing is taken under it
        self._pending: deque[_Queued] = deque()  # handed over, not yet taken by a thread to issue
        self._queued = 0  # stores handed over and not yet issued (0: no copy of ours due on the store stream)
        self._layered: set[LayeredLoad] = set()  # layered loads not fully enqueued yet

    def attach(self, device: torch.device) -> None:
        """Make the streams for a pool on ``device``. Call with the lock held and nothing in flight."""
        # Three distinct streams from torch's pool: store, load, and a spare used when the
        # caller's own stream happens to be one of ours (torch hands pool streams out in
        # rotation, so an engine's forward stream can alias a side stream).
        self.streams = self.kit.streams(device, 3)

    def open_store(self, stream: Any, lead: Move | None, on_fail: Callable[[], None]) -> StoreStart:
        """A store's first half: order its stream after ``stream`` (the caller's; None: the current
        one) and, if the issuer is idle, enqueue ``lead`` (its first copies) on it. The rest of the
        store follows with ``store``; a caller that cannot go on calls ``abandon``.

        Why two halves: the engine's bookkeeping for the rest of the store (its commit, the move
        over its later chunks, the transfer's record) is host time the copy engines would sit
        idle through on an idle GPU; done after the lead is enqueued, it runs while the lead
        copies (issue 19: ~20 us of a 256 KiB-block store's lead on an H100 host). ``on_fail``
        undoes the store (its slots) if it never completes; on CPU nothing runs here."""
        if self.streams is None:
            return StoreStart(None, None, False, lead, on_fail)
        caller = stream if stream is not None else self.kit.current(self.streams[0].device)
        side = self.side_stream(True, caller)
        with self._handoff:
            head = self.head_bytes > 0 and self._queued == 0  # idle: nothing of ours on ``side``
            self._queued += 1
        start = StoreStart(caller, side, head, lead, on_fail)
        if head:  # enqueued by this thread, before the hand-off: the issuer's windows come after
            try:
                self.kit.after(side, caller)
                if lead is not None:
                    start.started = True
                    with self.kit.use(side):
                        lead.rest()
            except BaseException:
                self.abandon(start)
                raise
        return start

    def abandon(self, start: StoreStart) -> None:
        """Give up a store after ``open_store``: ``on_fail`` now, or, where its lead's copies may
        still land in its slots, once they have run (a failed transfer in the FIFO)."""
        if self.streams is None:
            with self._lock:
                start.on_fail()
            return
        with self._handoff:
            self._queued -= 1
        if not start.started:
            with self._lock:
                start.on_fail()
            return
        transfer = _Transfer(next(self._tokens), start.on_fail, start.on_fail, self._after_enqueued(start.side),
                             _ISSUED, failed=True)
        with self._lock:
            self.inflight.append(transfer)

    def store(self, start: StoreStart, move: Move, on_done: Callable[[], None], *, lead_bytes: int = 0,
              check: Callable[[], None] | None = None) -> int | None:
        """The rest of a store opened by ``open_store``: run it now (CPU: ``on_fail`` and the error
        if it raises), or hand it to the issuer thread (CUDA: the error is logged, ``on_fail``
        runs once the copies that did go have run). Nothing is enqueued on the caller's stream
        itself: the store's stream waits for it.

        ``check`` runs after the lead (if the caller enqueued one), so that the copy engines work
        while the rest of the operation is validated (issue 19; ``lead_bytes`` count towards the
        caller's head); ``check`` raising fails the store (``on_fail`` once the lead's copies have
        run) and reaches the caller, and nothing of ``move`` is enqueued. On CPU, and with a
        busy issuer, ``check`` runs before anything is copied."""
        lead, on_fail = start.lead, start.on_fail
        if self.streams is None:
            return self._inline(_steps(check, lead and lead.rest, move.rest), on_done, on_fail)
        side, started = start.side, start.started
        ready = None
        try:
            if not start.head:
                ready = self.kit.event()
                ready.record(start.caller)
            if check is not None:
                check()
        except BaseException:  # the lead's copies, if any went, may still land: freed after them
            self.abandon(start)
            raise
        transfer = _Transfer(next(self._tokens), on_done, on_fail)
        with self._lock:
            self.inflight.append(transfer)
        if start.head and self.head_bytes > lead_bytes:
            with self.kit.use(side):
                move.head(self.head_bytes - lead_bytes)  # never raises: ``rest`` does, on the issuer
        moves = (move,) if started or lead is None else (lead, move)
        self._start_issuer()
        with self._handoff:
            self._pending.append(_Queued(transfer, moves, side, ready))
        self._wake.put(True)  # wakes the issuer (after the head: no GIL ping-pong)
        return transfer.token

    def load(self, copy: Callable[[], None], on_done: Callable[[], None], stream: Any, *,
             lead: Callable[[], None] | None = None, check: Callable[[], None] | None = None) -> int | None:
        """Run ``copy`` now (CPU), or enqueue it on a side stream ordered after ``stream`` and make
        ``stream`` wait for it (CUDA). If ``copy`` raises, ``on_done`` runs at once (no pin leaks)
        and the error reaches the caller.

        ``lead``: the load's first copies, enqueued before ``check`` runs (CUDA; on CPU ``check``
        runs first), so that the copy engines work while the rest is validated (issue 19). If
        ``check`` or ``copy`` raises after the lead, ``stream`` still waits for what was enqueued
        (those blocks were being written) and ``on_done`` runs once it has run."""
        if self.streams is None:
            return self._inline(_steps(check, lead, copy), on_done, on_done)
        caller = stream if stream is not None else self.kit.current(self.streams[0].device)
        side = self.side_stream(False, caller)
        started = False
        try:
            self.kit.after(side, caller)
            with self.kit.use(side):
                if lead is not None:
                    started = True
                    lead()
                if check is not None:
                    check()
                copy()
                event = side.record_event()
        except BaseException:
            if not started:  # nothing enqueued
                with self._lock:
                    on_done()
                raise
            event = self._after_enqueued(side)  # the lead wrote the caller's blocks: it waits for them
            if event is not None:
                caller.wait_event(event)
            self._enqueued(on_done, event)
            raise
        caller.wait_event(event)  # the forward pass reads what the load wrote
        return self._enqueued(on_done, event)

    def _enqueued(self, on_done: Callable[[], None], event: Any) -> int:
        """Track a load whose copies are all enqueued (before ``event``). It joins the FIFO only
        now, already issued: nobody can wait on it half-enqueued, and the first copies go
        without taking the owner's lock first."""
        transfer = _Transfer(next(self._tokens), on_done, on_done, event, _ISSUED)
        with self._lock:
            self.inflight.append(transfer)
        return transfer.token

    def _inline(self, copy: Callable[[], None], on_done: Callable[[], None], on_fail: Callable[[], None]) -> None:
        """A CPU pool's copy, done in the call."""
        try:
            copy()
        except BaseException:
            with self._lock:
                on_fail()
            raise
        with self._lock:
            on_done()

    def start_layered(self, layers: Iterator[int], num_layers: int, on_done: Callable[[], None],
                      stream: Any, on_layer: Callable[[int, Any], None] | None = None) -> LayeredLoad:
        """A CUDA load of ``num_layers`` layers, ordered after ``stream``'s work so far, whose
        layers are enqueued as the answer is waited on (``layers``: each ``next()`` enqueues the
        next one on the current stream); the first ``layers_ahead`` are enqueued now, so that a
        failure to enqueue at all reaches the caller, and the rest by the layer thread (with
        ``layer_thread``) or by the waits. ``stream`` is not made to wait.
        ``on_layer``: see ``LayeredLoad`` (a server's signal of each layer, on the copy stream);
        such a load is left to its caller (a server: its handler or its ``LayerIssuer``, which
        runs in the server's process beside the client's forward) and nothing is enqueued here:
        layers enqueued before a server's reply only delay the client's forward (issue 19,
        eighteenth pass: ~0.45 ms at 4K tokens of an 8B model, ~2 ms at 32K)."""
        assert self.streams is not None
        caller = stream if stream is not None else self.kit.current(self.streams[0].device)
        side = self.side_stream(False, caller)
        with self._lock:
            transfer = _Transfer(next(self._tokens), on_done, on_done)
            self.inflight.append(transfer)
        side.wait_stream(caller)
        events = [self.kit.event() for _ in range(num_layers)]

        def issued(error: BaseException | None) -> None:
            if error is None:
                transfer.event = events[-1]  # the last layer's copies end the load (one stream, in order)
            else:  # unpinned once what was enqueued has run; the waiters hear of it from the load
                logger.error("kvdepot: a layered load's copies could not all be enqueued: %s", error)
                try:
                    transfer.event = side.record_event()
                except BaseException:  # a broken device: nothing of it will run anyway
                    transfer.event = None
            with self._lock:
                self._layered.discard(load)
            transfer.issued.set()

        load = LayeredLoad(iter(layers), events, side, issued, self.layers_ahead, on_layer, self.kit.use)
        with self._lock:
            self._layered.add(load)
        load.issue_through(0 if on_layer is not None else self.layers_ahead)
        if self.layer_thread and on_layer is None and not load.fully_issued:
            with self._lock:
                if self._layer_issuer is None:
                    self._layer_issuer = LayerIssuer("kvdepot-layers")
                issuer = self._layer_issuer
            load.helped = True
            issuer.submit(load.issue_rest)
        return load

    def _finish_layered(self) -> None:
        """Enqueue the rest of every layered load: someone is about to wait for the transfers."""
        with self._lock:
            pending = list(self._layered)
        for load in pending:  # outside the lock: issuing takes the load's lock, then ours
            load.finish()

    def side_stream(self, store: bool, caller: Any) -> Any:
        """The stream a copy runs on: never the caller's, or the caller would wait for it."""
        assert self.streams is not None
        side = self.streams[0 if store else 1]
        return self.streams[2] if side == caller else side

    def poll_locked(self) -> None:
        while self.inflight and self.inflight[0].finished():
            self.inflight.popleft().complete()

    def poll(self) -> None:
        with self._lock:
            self.poll_locked()

    def is_complete(self, token: int) -> bool:
        with self._lock:
            self.poll_locked()
            return not any(t.token == token for t in self.inflight)

    def wait_for(self, token: int) -> None:
        """Block until transfer ``token`` has completed, and with it every one before it (they
        complete in order): what nobody has enqueued yet is enqueued by this thread."""
        self._finish_layered()  # transfers complete in order: one may sit behind a layered load
        self._issue_queued(token)
        self._wait_until(lambda: all(t.token != token for t in self.inflight))

    def wait_all(self) -> None:
        self._finish_layered()
        self._issue_queued(None)
        self._wait_until(lambda: not self.inflight)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Synchronize the oldest transfer in turn until ``done()`` (read under the lock): the
        oldest is what completion waits on, whichever stream a later one ran on."""
        while True:
            with self._lock:
                self.poll_locked()
                if done():
                    return
                head = self.inflight[0]
            head.synchronize()  # outside the lock: the issuer may still be enqueuing it

    def close(self) -> None:
        """Complete everything in flight and stop the issuer thread."""
        self.wait_all()
        with self._lock:
            issuer, self._issuer = self._issuer, None
            layers, self._layer_issuer = self._layer_issuer, None
        if issuer is not None:
            self._wake.put(None)
            issuer.join()
        if layers is not None:
            layers.close()

    # ---- the store issuer ----------------------------------------------------------------------
    def _start_issuer(self) -> None:
        with self._lock:
            if self._issuer is None:
                self._issuer = threading.Thread(target=self._issue_stores, name="kvdepot-store-issuer", daemon=True)
                self._issuer.start()

    def _issue_stores(self) -> None:
        while self._wake.get() is not None:
            self._issue_queued(None, one=True)  # nothing where a waiter took it first

    def _issue_queued(self, token: int | None, *, one: bool = False) -> None:
        """Enqueue handed-over stores, oldest first, through the one of transfer ``token`` (None:
        all of them, or with ``one`` just the oldest), unless another thread took it already."""
        with self._issuing:
            while True:
                with self._handoff:
                    if not self._pending or (token is not None and all(q.transfer.token != token for q in self._pending)):
                        return
                    item = self._pending.popleft()
                self._issue(item)
                if one or item.transfer.token == token:
                    return

    def _issue(self, item: _Queued) -> None:
        """Enqueue the rest of one store and record its event. An error is logged, not raised (the
        store is dropped: ``on_fail`` once whatever it did enqueue has run); only an interrupt of
        the thread (a waiter's ``KeyboardInterrupt``) goes on up, after the same."""
        transfer, side = item.transfer, item.side
        try:
            with self.kit.use(side):
                if item.ready is not None:
                    side.wait_event(item.ready)
                for move in item.moves:
                    move.rest()
                transfer.event = side.record_event()
        except BaseException as exc:  # never commit slots whose copies were not all enqueued
            logger.exception("kvdepot: a store's copies could not be enqueued; its chunks are dropped")
            transfer.failed = True
            transfer.event = self._after_enqueued(side)
            if not isinstance(exc, Exception):  # an interrupt of a waiting thread reaches it
                raise
        finally:
            # Nothing here takes the owner's lock: a thread that waits for this store may hold it
            # (re-registering a pool waits for every copy under it).
            transfer.issued.set()
            with self._handoff:
                self._queued -= 1

    def _after_enqueued(self, side: Any) -> Any:
        """An event after whatever a failed store did enqueue, so that its slots are freed only
        once no copy of it can still land in them; None where even that fails (nothing will run)."""
        try:
            with self.kit.use(side):
                return side.record_event()
        except BaseException:  # NOTE: a broken device; the slots are freed at once
            return None


def _steps(*steps: Callable[[], None] | None) -> Callable[[], None]:
    """One call of ``steps`` in order (None: skipped): a CPU pool's operation, done in the call."""

    def run() -> None:
        for step in steps:
            if step is not None:
                step()

    return run
