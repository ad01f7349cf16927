"""A layered load's later layers enqueued by a helper thread (``LayeredLoad.issue_rest`` on a
``LayerIssuer``), beside the forward that waits for them (CPU: the mover is a generator that logs
each layer, the events are flags; the CUDA path runs in the GPU suite's layered loads).

What must hold whichever thread gets there first: every layer is enqueued once, in order; no
stream waits for an event before it is recorded; a failure reaches the forward's wait of the
first layer not enqueued, after the copies that did go."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdepot.transfer.inflight import InflightTransfers
from kvdepot.transfer.layered import LayeredLoad, LayerIssuer, TransferFailed
from kvdepot.transfer.streams import ImmediateStreams

LAYERS = 8


class _Event:
    def __init__(self, log: list, layer: int) -> None:
        self.log, self.layer, self.recorded = log, layer, False

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        self.log.append(("recorded", self.layer))

    def query(self) -> bool:  # an immediate stream's copies ran as they were enqueued
        return self.recorded

    def synchronize(self) -> None:
        pass


class _Stream:
    """The forward's stream: refuses a wait for an event not recorded (it would pass at once)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, event: _Event) -> None:
        assert event.recorded, f"waited for layer {event.layer} before its event was recorded"
        self.log.append(("waited", event.layer))

    def wait_stream(self, other: Any) -> None:
        self.log.append(("fenced", None))


def _load(log: list, *, gate: dict[int, threading.Event] | None = None, fail_at: int | None = None,
          ahead: int = 2) -> tuple[LayeredLoad, list]:
    """A load whose mover logs (layer, thread name) per layer; a layer in ``gate`` waits for its
    event first (a helper caught inside a driver call), ``fail_at`` raises there."""
    ended: list = []

    def mover():
        for layer in range(LAYERS):
            if gate and layer in gate:
                assert gate[layer].wait(10)
            if layer == fail_at:
                raise RuntimeError("the driver said no")
            log.append(("enqueued", layer, threading.current_thread().name))
            yield layer

    return LayeredLoad(mover(), [_Event(log, n) for n in range(LAYERS)], None, ended.append, ahead), ended


def _helper_finishes(load: LayeredLoad) -> None:
    """As ``start_layered`` runs a load: its first layers enqueued here, the rest handed to a
    helper thread ("helper"), waited for until its job has ended."""
    load.issue_through(load.ahead)
    load.helped = True
    issuer = LayerIssuer("helper")
    try:
        issuer.submit(load.issue_rest)
        assert issuer.drain(10)
    finally:
        issuer.close()


def _enqueued(log: list) -> list[int]:
    return [step[1] for step in log if step[0] == "enqueued"]


def test_a_helper_ahead_of_the_forward_enqueues_the_rest_and_the_forward_only_waits() -> None:
    log: list = []
    load, ended = _load(log)
    load.issue_through(load.ahead)  # what start_layered enqueues in the caller
    load.helped = True
    issuer = LayerIssuer("helper")
    try:
        issuer.submit(load.issue_rest)
        assert issuer.drain(10)
        stream = _Stream(log)
        for layer in range(LAYERS):
            load.wait_layer(layer, stream)
    finally:
        issuer.close()
    assert _enqueued(log) == list(range(LAYERS))
    by = {step[1]: step[2] for step in log if step[0] == "enqueued"}
    assert {by[n] for n in range(load.ahead, LAYERS)} == {"helper"}  # the forward enqueued none of them
    assert ended == [None] and load.fully_waited


def test_the_helper_makes_the_side_stream_current_once_per_load_and_records_each_event_on_it() -> None:
    """What the helper's Python costs the forward's thread, it costs per layer (issue 19): one
    stream context for its whole job, every layer's copies and event on the side stream."""
    side, current, log, entered = object(), threading.local(), [], []

    @contextlib.contextmanager
    def use(stream: Any) -> Iterator[None]:
        entered.append(threading.current_thread().name)
        before, current.stream = getattr(current, "stream", None), stream
        try:
            yield
        finally:
            current.stream = before

    class Event:
        def __init__(self, layer: int) -> None:
            self.layer = layer

        def record(self, stream: Any = None) -> None:
            log.append(("recorded", self.layer, stream is side))

    def mover():
        for layer in range(LAYERS):
            log.append(("enqueued", layer, getattr(current, "stream", None) is side))
            yield layer

    load = LayeredLoad(mover(), [Event(n) for n in range(LAYERS)], side, lambda exc: None, 2, use=use)
    _helper_finishes(load)
    assert log == [step for n in range(LAYERS) for step in (("enqueued", n, True), ("recorded", n, True))]
    assert entered == [threading.current_thread().name, "helper"]
    load.issue_through(LAYERS)  # nothing left: no stream context at all
    assert len(entered) == 2


def test_a_forward_that_needs_a_layer_the_helper_is_enqueueing_waits_for_it_and_nothing_goes_twice() -> None:
    log: list = []
    gate = {3: threading.Event()}
    load, ended = _load(log, gate=gate, ahead=0)
    load.issue_through(1)
    load.helped = True
    issuer = LayerIssuer("helper")
    stream = _Stream(log)
    try:
        issuer.submit(load.issue_rest)
        load.wait_layer(0, stream)
        load.wait_layer(1, stream)
        load.wait_layer(2, stream)
        waiter = threading.Thread(target=load.wait_layer, args=(3, stream), name="forward")
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and ("waited", 3) not in log  # behind the helper's layer 3, not past it
        gate[3].set()
        waiter.join(10)
        assert not waiter.is_alive()
        for layer in range(4, LAYERS):
            load.wait_layer(layer, stream)
    finally:
        gate[3].set()
        issuer.close()
    assert _enqueued(log) == list(range(LAYERS))
    assert log.index(("recorded", 3)) < log.index(("waited", 3))
    assert ended == [None]


def test_a_forward_waits_for_layers_the_helper_enqueued_without_queueing_behind_its_next_driver_call() -> None:
    log: list = []
    gate = {5: threading.Event()}
    load, ended = _load(log, gate=gate)
    load.issue_through(load.ahead)
    load.helped = True
    issuer = LayerIssuer("helper")
    stream = _Stream(log)
    try:
        issuer.submit(load.issue_rest)
        while load.issued < 5:  # the helper is now inside layer 5's copies, holding the load's lock
            threading.Event().wait(0.001)
        forward = threading.Thread(target=lambda: [load.wait_layer(n, stream) for n in range(5)], name="forward")
        forward.start()
        forward.join(5)
        assert not forward.is_alive()  # layers 0-4 were in: no wait for the lock
        assert [step[1] for step in log if step[0] == "waited"] == [0, 1, 2, 3, 4]
    finally:
        gate[5].set()
        issuer.close()
    assert _enqueued(log) == list(range(LAYERS)) and ended == [None]


def test_a_forward_ahead_of_a_helper_not_yet_running_enqueues_for_itself() -> None:
    log: list = []
    load, ended = _load(log, ahead=1)
    load.issue_through(1)
    load.helped = True  # handed over, but the helper thread has not run yet
    stream = _Stream(log)
    for layer in range(3):
        load.wait_layer(layer, stream)
    load.issue_rest()  # the helper, late: only what is left
    for layer in range(3, LAYERS):
        load.wait_layer(layer, stream)
    assert _enqueued(log) == list(range(LAYERS))
    assert [step[2] for step in log if step[0] == "enqueued"][:4] == ["MainThread"] * 4  # through 2 + 1 ahead
    assert ended == [None]


def test_a_helper_that_fails_fails_the_forward_at_the_first_layer_not_enqueued() -> None:
    log: list = []
    load, ended = _load(log, fail_at=5)
    _helper_finishes(load)  # the failure is the load's, not a job's error
    assert _enqueued(log) == [0, 1, 2, 3, 4]
    assert len(ended) == 1 and isinstance(ended[0], RuntimeError)
    stream = _Stream(log)
    with pytest.raises(TransferFailed, match="after 5 layers"):
        load.wait_layer(0, stream)
    assert ("fenced", None) in log  # the copies that went land before the blocks' next use
    assert ("waited", 0) not in log


def test_a_side_stream_that_cannot_be_made_current_fails_the_load_as_a_failed_enqueue_does(caplog) -> None:
    """The stream context is entered outside the enqueue's own failure handling: failing there
    must still reach ``on_issued`` once and every later wait, not leave the load half-issued."""
    log: list = []
    ended: list = []

    @contextlib.contextmanager
    def use(stream: Any) -> Iterator[None]:
        if threading.current_thread().name == "helper":
            raise RuntimeError("cannot make the side stream current")
        yield

    def mover():
        for layer in range(LAYERS):
            log.append(("enqueued", layer, threading.current_thread().name))
            yield layer

    load = LayeredLoad(mover(), [_Event(log, n) for n in range(LAYERS)], None, ended.append, 2, use=use)
    _helper_finishes(load)
    assert "a layer job failed" not in caplog.text  # the load's failure, not the job's
    assert _enqueued(log) == [0, 1]
    assert len(ended) == 1 and isinstance(ended[0], RuntimeError) and load.fully_issued
    stream = _Stream(log)
    with pytest.raises(TransferFailed, match="after 2 layers"):
        load.wait_layer(0, stream)
    assert ("fenced", None) in log and ("waited", 0) not in log  # what went lands before the blocks' next use
    assert len(ended) == 1


class _Recording(ImmediateStreams):
    """Immediate streams whose events are the test's flags."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log, self.made = log, 0

    def event(self) -> _Event:
        self.made += 1
        return _Event(self.log, self.made - 1)


def _tracker(log: list, layer_thread: bool = True) -> InflightTransfers:
    transfers = InflightTransfers(threading.RLock(), 2, _Recording(log), layer_thread=layer_thread)
    transfers.attach(torch.device("cpu"))
    return transfers


def _layers(log: list):
    for layer in range(LAYERS):
        log.append(("enqueued", layer, threading.current_thread().name))
        yield layer


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "kvdepot-layers"]


def test_the_tracker_hands_a_load_s_rest_to_its_layer_thread_and_stops_it_at_close() -> None:
    log: list = []
    done: list = []
    transfers = _tracker(log)
    load = transfers.start_layered(_layers(log), LAYERS, lambda: done.append(True), None)
    assert load.helped and _threads() == ["kvdepot-layers"]
    transfers.wait_all()
    assert _enqueued(log) == list(range(LAYERS)) and done == [True]
    assert {step[2] for step in log if step[0] == "enqueued" and step[1] >= 2} <= {"kvdepot-layers", "MainThread"}
    transfers.close()
    assert _threads() == []


def test_a_signalled_load_and_a_tracker_without_the_thread_leave_the_rest_to_the_waits() -> None:
    """A server's load (signalled) enqueues nothing in the call: its caller's issuer does all of it,
    after the reply; a tracker without the thread enqueues its first layers and leaves the rest."""
    log: list = []
    transfers = _tracker(log)
    signalled = transfers.start_layered(_layers(log), LAYERS, lambda: None, None, on_layer=lambda layer, side: None)
    assert not signalled.helped and _threads() == [] and _enqueued(log) == []
    signalled.enqueue_through(0)  # what the server's issuer (or its handler) does next
    assert _enqueued(log) == [0]
    transfers.close()
    log.clear()
    off = _tracker(log, layer_thread=False)
    plain = off.start_layered(_layers(log), LAYERS, lambda: None, None)
    assert not plain.helped and _threads() == [] and _enqueued(log) == [0, 1]
    off.close()
    assert _enqueued(log) == list(range(LAYERS))  # close enqueues what nobody waited for
