"""Loads by layer answered early (``server/layer_progress.py``), on CPU with a scripted load: the
reply before the last layer, records in layer order each after its layer's wait, a second load
behind the first, and every failure mid-way (a layer not enqueued, the deadline, the server gone)
reaching the client's wait for that layer as ``TransferFailed`` — never a wait on an event not
recorded for the load. The CUDA half (bit-exact, across processes) is tests/server/test_gpu_ipc.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvdepot.config import DepotConfig
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.calls import ServerUnavailable
from kvdepot.server.ipc import ServerLayeredLoad
from kvdepot.server.layer_follow import FencedFailure, RemoteProgress
from kvdepot.server.layer_progress import (
    MAX_LOADS,
    LayerIssuer,
    LayerProgress,
    LoadBook,
    start_early,
)
from kvdepot.server.service import DepotService
from kvdepot.transfer.layered import LayeredLoad, LayerWaits, TransferFailed

LAYERS = 8


class ScriptedLoad(LayerWaits):
    """A load whose layer enqueues are logged, may be held at a layer, or fail at one;
    ``on_layer(layer)`` runs as each layer is enqueued, as ``LayeredLoad``'s records its event."""

    def __init__(self, log: list, name: str = "a", hold_at: int | None = None, fail_at: int | None = None,
                 on_layer: Callable[[int], None] | None = None) -> None:
        super().__init__(LAYERS)
        self.log, self.name, self.hold_at, self.fail_at, self.on_layer = log, name, hold_at, fail_at, on_layer
        self.gate, self.held = threading.Event(), threading.Event()
        self.abandoned: BaseException | None = None

    def _wait(self, layer: int, stream: object) -> None:
        raise AssertionError("the server's issuer makes no stream wait for a layer")

    def enqueue_through(self, layer: int) -> None:  # a LayeredLoad records the layer's event as it enqueues it
        self._step(layer, "enqueue")

    def _step(self, layer: int, what: str) -> None:
        if layer == self.hold_at:
            self.held.set()
            assert self.gate.wait(10)
        if layer == self.fail_at:
            raise TransferFailed(f"layer {layer} could not be enqueued")
        self.log.append((self.name, what, layer))
        if self.on_layer is not None:
            self.on_layer(layer)

    def abandon(self, reason: BaseException) -> None:
        self.abandoned = reason

    def wait_enqueued(self, stream: object) -> None:
        self.log.append((self.name, "fence", None))


def _early(load: ScriptedLoad, issuer: LayerIssuer, deadline_ns: int = 0) -> tuple[LayerProgress, list[int]]:
    progress = LayerProgress(1, LAYERS, deadline_ns)
    ended: list[int] = []
    start_early(load, progress, issuer, lambda layer: load.log.append((load.name, "record", layer)), None,
                lambda: ended.append(1))
    return progress, ended


def _client(progress: LayerProgress, pool: ThreadPoolExecutor, timeout_s: float = 2.0) -> RemoteProgress:
    """The client's follower, its LAYERS answered by the server-side progress (as the service does)."""
    asked: list[int] = []

    def ask(through: int) -> Future:
        asked.append(through)
        return pool.submit(lambda: (p.LayersReply(*progress.wait_past(through)), []))

    follow = RemoteProgress(ask, progress.recorded, LAYERS, timeout_s)
    follow.asked = asked  # type: ignore[attr-defined]
    return follow


def test_reply_comes_before_the_last_layer_and_the_issuer_only_enqueues_the_rest_in_order():
    """Each layer's event is recorded by the load as it enqueues the layer (on its copy stream):
    the issuer makes no stream wait and records nothing itself while the load goes well."""
    log: list = []
    load = ScriptedLoad(log, hold_at=3)
    issuer = LayerIssuer("test-layers")
    try:
        progress, ended = _early(load, issuer)
        # What the reply carries: layer 0 recorded, the rest still to come on the issuer.
        assert progress.recorded == 1 and log == [("a", "enqueue", 0)]
        progress.wait_past(2, 5.0)
        assert progress.recorded == 3 and not issuer.idle and not ended  # held at layer 3's enqueue
        load.gate.set()
        assert issuer.drain(5)
        assert log == [("a", "enqueue", layer) for layer in range(LAYERS)]
        assert progress.recorded == LAYERS and not progress.failed and ended == [1]
        assert load.abandoned is None
    finally:
        issuer.close()


class _Page:
    """A progress page stand-in: what ``LayerProgress`` writes to it, in order."""

    def __init__(self) -> None:
        self.words: list[tuple] = []

    def write(self, *word: object) -> None:
        self.words.append(word)


def test_with_a_page_the_reply_comes_before_any_layer_and_the_issuer_enqueues_them_all():
    """A client that reads the progress page is answered before layer 0 is enqueued: the issuer
    enqueues every layer, and the client still waits for each one to be recorded, layer 0
    included."""
    log: list = []
    load = ScriptedLoad(log, hold_at=0)
    issuer = LayerIssuer("test-layers")
    with ThreadPoolExecutor(2) as pool:
        try:
            progress = LayerProgress(1, LAYERS, page=_Page())  # type: ignore[arg-type]
            ended: list[int] = []
            start_early(load, progress, issuer, lambda layer: None, None, lambda: ended.append(1))
            assert progress.recorded == 0  # what the reply carries: nothing recorded yet
            follow = _client(progress, pool)
            waiting = pool.submit(follow.through, 0)
            assert load.held.wait(5)  # the issuer is at layer 0's enqueue, held there
            time.sleep(0.05)
            assert not waiting.done() and log == []  # layer 0 not enqueued: the client must not go on
            load.gate.set()
            waiting.result(5)
            assert issuer.drain(5) and ended == [1]
            assert log == [("a", "enqueue", layer) for layer in range(LAYERS)]
            assert progress.recorded == LAYERS and not progress.failed
        finally:
            load.gate.set()
            issuer.close()


def test_layer_0_that_fails_before_the_reply_raises_there_and_after_it_fails_the_client_s_first_wait():
    """No page: layer 0 fails in the handler (an error reply; nothing queued, the load abandoned,
    ``on_end`` the caller's). With one the issuer meets the failure: fenced, and the client's
    wait for layer 0 raises."""
    issuer = LayerIssuer("test-layers")
    with ThreadPoolExecutor(2) as pool:
        try:
            load = ScriptedLoad([], fail_at=0)
            progress, ended = LayerProgress(1, LAYERS), []
            with pytest.raises(TransferFailed):
                start_early(load, progress, issuer, lambda layer: None, None, lambda: ended.append(1))
            assert load.abandoned is not None and issuer.idle and ended == [] and progress.recorded == 0
            log: list = []
            load = ScriptedLoad(log, fail_at=0)
            progress, ended = LayerProgress(2, LAYERS, page=_Page()), []  # type: ignore[arg-type]
            start_early(load, progress, issuer, lambda layer: log.append(("record", layer)), None,
                        lambda: ended.append(1))
            assert issuer.drain(5) and ended == [1] and load.abandoned is not None
            assert progress.failed and progress.fenced and progress.recorded == 0
            assert log == [("a", "fence", None)] + [("record", layer) for layer in range(LAYERS)]
            with pytest.raises(TransferFailed):
                _client(progress, pool).through(0)
        finally:
            issuer.close()


def test_the_client_waits_for_each_layer_until_the_server_recorded_it():
    log: list = []
    load = ScriptedLoad(log, hold_at=5)
    issuer = LayerIssuer("test-layers")
    with ThreadPoolExecutor(2) as pool:
        try:
            progress, _ = _early(load, issuer)
            follow = _client(progress, pool)
            follow.through(4)  # recorded by the issuer meanwhile
            assert follow.ready >= 5
            waiting = pool.submit(follow.through, 6)
            time.sleep(0.05)
            assert not waiting.done()  # layer 5 is held: the client must not go past it
            load.gate.set()
            waiting.result(5)
            assert ("a", "enqueue", 6) in log
            follow.through(LAYERS - 1)
            assert follow.ready == LAYERS
        finally:
            load.gate.set()
            issuer.close()


def test_a_layer_not_enqueued_fails_that_layer_and_every_later_one_for_the_client():
    log: list = []
    load = ScriptedLoad(log, fail_at=5)
    issuer = LayerIssuer("test-layers")
    with ThreadPoolExecutor(2) as pool:
        try:
            progress, ended = _early(load, issuer)
            assert issuer.drain(5)
            assert progress.recorded == 5 and "TransferFailed" in progress.failed and ended == [1]
            assert isinstance(load.abandoned, TransferFailed)  # nothing more of it is enqueued
            # The fence: the remaining events recorded after every copy that went, then failed.
            assert log == ([("a", "enqueue", n) for n in range(5)] + [("a", "fence", None)]
                           + [("a", "record", n) for n in range(5, LAYERS)])
            assert progress.fenced
            follow = _client(progress, pool)
            follow.through(4)  # recorded before the failure: still valid
            for layer in (5, 6, LAYERS - 1):
                with pytest.raises(FencedFailure, match="after 5 layers"):
                    follow.through(layer)
        finally:
            issuer.close()


def test_the_deadline_stops_the_issue_and_fails_the_rest():
    log: list = []
    load = ScriptedLoad(log, hold_at=2)
    issuer = LayerIssuer("test-layers")
    try:
        progress, ended = _early(load, issuer, deadline_ns=time.monotonic_ns() + 60_000_000_000)
        assert load.held.wait(5)
        progress.deadline_ns = time.monotonic_ns() - 1  # the deadline passes while layer 2 is held
        load.gate.set()
        assert issuer.drain(5)
        assert progress.recorded == 3 and "deadline" in progress.failed and ended == [1]
        assert load.abandoned is not None and ("a", "enqueue", 3) not in log and progress.fenced
    finally:
        issuer.close()


def test_a_second_load_is_recorded_wholly_after_the_first():
    log: list = []
    first, second = ScriptedLoad(log, "a", hold_at=2), ScriptedLoad(log, "b")
    issuer = LayerIssuer("test-layers")
    try:
        one, _ = _early(first, issuer)
        two, _ = _early(second, issuer)  # the issuer is busy: nothing of it is recorded in the handler
        assert two.recorded == 0 and not [e for e in log if e[0] == "b"]
        first.gate.set()
        assert issuer.drain(5)
        assert [(name, layer) for name, _, layer in log] == [("a", layer) for layer in range(LAYERS)] + [("b", layer) for layer in range(LAYERS)]
        assert one.recorded == two.recorded == LAYERS
    finally:
        issuer.close()


def test_a_server_gone_mid_load_fails_the_layers_not_yet_known():
    def ask(through: int) -> Future:
        future: Future = Future()
        future.set_exception(ServerUnavailable("no reply from the server within 2 s"))
        return future

    follow = RemoteProgress(ask, 2, LAYERS, 0.1)
    follow.through(1)  # recorded before the reply
    with pytest.raises(TransferFailed, match="ServerUnavailable") as failure:
        follow.through(2)
    assert not isinstance(failure.value, FencedFailure)  # nothing the client could wait on
    with pytest.raises(TransferFailed):
        follow.through(LAYERS - 1)


class LoggedServerLoad(ServerLayeredLoad):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waited_events: list[int] = []

    def _wait_event(self, layer: int, stream: object) -> None:
        self.waited_events.append(layer)


def test_a_fenced_failure_waits_on_the_last_event_before_it_raises():
    import torch

    def progress(layer: int) -> None:
        if layer >= 3:
            raise FencedFailure("the server's layered load failed after 3 layers")

    load = LoggedServerLoad([object()] * LAYERS, torch.device("cpu"), progress, 1)
    for layer in range(3):
        load.wait_layer(layer, None)
    with pytest.raises(FencedFailure):
        load.wait_layer(3, None)
    assert load.waited_events == [0, 1, 2, LAYERS - 1] and load.waited == 3


def test_an_in_process_load_that_fails_makes_the_waiter_wait_for_what_went():
    class Stream:
        def __init__(self) -> None:
            self.log: list = []

        def wait_event(self, event: object) -> None:
            self.log.append(("event", event))

        def wait_stream(self, other: object) -> None:
            self.log.append(("stream", other))

    class Event:
        def __init__(self, n: int) -> None:
            self.n = n

        def record(self, stream: object = None) -> None:
            pass

    def layers():
        yield 0
        yield 1
        raise RuntimeError("the driver refused layer 2")

    seen: list = []
    events = [Event(n) for n in range(4)]
    load = LayeredLoad(layers(), events, None, seen.append, ahead=0)
    stream = Stream()
    load.wait_layer(0, stream)
    load.wait_layer(1, stream)
    with pytest.raises(TransferFailed):
        load.wait_layer(2, stream)
    assert stream.log == [("event", events[0]), ("event", events[1]), ("stream", None)]
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)


def test_a_server_layered_load_asks_before_it_waits_on_an_event():
    asked: list[int] = []

    def progress(layer: int) -> None:
        asked.append(layer)
        raise TransferFailed("the server's layered load failed after 0 layers")

    import torch

    load = ServerLayeredLoad([object()] * LAYERS, torch.device("cpu"), progress, 0)
    assert load.ready_at_reply == 0
    with pytest.raises(TransferFailed):  # raised before any CUDA call (which would fail here otherwise)
        load.wait_layer(3, None)
    assert asked == [3] and load.waited == 0


class _Logged:
    """A CPU stand-in for a layer's event or the copy stream, logging what is enqueued."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: object = None) -> None:
        self.log.append(("event", self.name, stream))


def test_a_layered_load_signals_each_layer_right_after_enqueueing_it_on_its_copy_stream():
    log: list = []
    side = object()

    def layers():
        for layer in range(6):
            log.append(("copies", layer))
            yield layer

    load = LayeredLoad(layers(), [_Logged(log, n) for n in range(6)], side, lambda exc: None, ahead=2,
                       on_layer=lambda layer, stream: log.append(("signal", layer, stream is side)))
    load.issue_through(2)  # what start_layered enqueues at once
    load.enqueue_through(3)
    load.finish()
    assert log == [step for n in range(6) for step in (("copies", n), ("event", n, side), ("signal", n, True))]


def test_a_layer_signal_that_fails_fails_the_load_there():
    seen: list = []

    def signal(layer: int, stream: object) -> None:
        if layer == 2:
            raise RuntimeError("cudaEventRecord failed")

    load = LayeredLoad(iter(range(4)), [_Logged([], n) for n in range(4)], None, seen.append, ahead=0, on_layer=signal)
    load.enqueue_through(1)
    with pytest.raises(TransferFailed, match="after 2 layers"):
        load.enqueue_through(2)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError) and load.fully_issued
    with pytest.raises(TransferFailed):
        load.enqueue_through(3)


def test_an_abandoned_layered_load_enqueues_nothing_more_and_reports_once():
    seen: list = []
    load = LayeredLoad(iter(range(4)), [object()] * 4, None, seen.append)
    reason = RuntimeError("deadline")
    load.abandon(reason)
    load.abandon(RuntimeError("again"))
    assert seen == [reason] and load.fully_issued
    with pytest.raises(TransferFailed):
        load.issue_through(1)


def test_the_book_keeps_live_loads_and_drops_old_finished_ones():
    book = LoadBook()
    live = LayerProgress(1, LAYERS)
    book.add(7, live)
    for load_id in range(2, MAX_LOADS + 10):
        done = LayerProgress(load_id, LAYERS)
        done.advance(LAYERS)
        book.add(7, done)
    assert book.get(7, 1) is live and len(book) > MAX_LOADS  # the oldest is live: nothing goes past it
    live.advance(LAYERS)
    book.add(7, LayerProgress(1000, LAYERS))
    assert book.get(7, 1) is None and len(book) == MAX_LOADS and book.get(8, 1000) is None
    book.drop(7)
    assert len(book) == 0


def test_the_service_answers_layers_inline_when_known_and_on_the_pool_otherwise():
    service = DepotService(DepotConfig(), url="ipc:///tmp/none")
    try:
        peer = b"peer"
        hello, _ = service.hello(peer, p.Hello(p.PROTOCOL_VERSION), [])
        progress = LayerProgress(5, LAYERS)
        progress.advance(2)
        service.layer_loads.add(hello.session_id, progress)
        spec = p.OPS[p.Op.LAYERS]
        frames = service.try_inline(peer, 1, spec, p.Layers(5, 1), [])
        assert frames is not None and w.parse_reply_header(frames[0]).status == 0
        assert w.decode(frames[1], p.LayersReply) == p.LayersReply(2)
        assert service.try_inline(peer, 2, spec, p.Layers(5, 4), []) is None  # would wait: the pool's
        threading.Timer(0.05, progress.fail, ("TransferFailed: layer 2",)).start()
        reply, _ = service.layers(peer, p.Layers(5, 4), [])
        assert reply == p.LayersReply(2, "TransferFailed: layer 2")
        unknown = service.dispatch(peer, 3, spec, p.Layers(6, 0), [])  # another load id: refused
        assert w.parse_reply_header(unknown[0]).status == p.ErrorCode.UNKNOWN_REQUEST
        service.end_session(peer, p.EndSession(), [])
        assert len(service.layer_loads) == 0  # a session's loads go with it
    finally:
        service.close()
