"""The progress page (``server/progress_page.py``) and the forward's wait that reads it
(``server/layer_follow.py``), on CPU with scripted loads: a word is written only after the events
it counts are recorded; a stale or foreign word only ever under-reports; the wait asks no LAYERS
while the page answers; and every failure — a layer not enqueued, the deadline, a server gone, a
slot another load took, a session gone — ends in ``TransferFailed`` from that layer's wait, as
with LAYERS alone. The files and mappings are checked to go away."""

from __future__ import annotations

import gc
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from test_layer_progress import LAYERS, ScriptedLoad, _client

from kvdepot.server import protocol as p
from kvdepot.server.calls import ServerUnavailable
from kvdepot.server.layer_follow import FencedFailure, FollowStats, RemoteProgress, Watch
from kvdepot.server.layer_progress import LayerIssuer, LayerProgress, start_early
from kvdepot.server.progress_page import (
    PAGE_BYTES,
    PREFIX,
    SLOTS,
    PageError,
    ProgressPage,
    Seen,
    decode,
    encode,
    serve_page,
)
from kvdepot.transfer.layered import TransferFailed

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="mapping checks read /proc")


def _mapped(path: str, pid: int | str = "self") -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any(path in line for line in maps)


@pytest.fixture
def pages():
    """A client's page and the server's mapping of it (the file unlinked, as after REGISTER)."""
    client = ProgressPage.create()
    server = ProgressPage.open(client.path)
    client.unlink()
    yield client, server
    client.close()
    server.close()


def test_a_word_read_for_its_load_for_an_older_one_and_for_a_later_one():
    word = encode(70, 5)
    assert decode(word, 70, LAYERS) == Seen(5)
    assert decode(word, 71, LAYERS) == Seen(0)  # the slot still holds an older load: nothing yet
    assert decode(word, 69, LAYERS) is None  # a later load took the slot: the page cannot tell
    assert decode(encode(70, LAYERS + 1), 70, LAYERS) is None  # more layers than the load has: not trusted
    assert decode(encode(70, 3, 2, True), 70, LAYERS) == Seen(3, 2, True)
    assert decode(encode(2**50 + 70, 1), 70, LAYERS) == Seen(1)  # ids are kept modulo 2**50 on both sides
    assert decode(0, 1, LAYERS) == Seen(0)  # a fresh page says nothing of anyone


def test_the_server_writes_what_the_client_reads_and_the_file_is_gone(pages):
    client, server = pages
    assert not os.path.exists(client.path)  # unlinked: nothing left in /dev/shm, both mappings stay
    assert _mapped(client.path)
    assert client.read(9, LAYERS) == Seen(0)
    server.write(9, 4)
    assert client.read(9, LAYERS) == Seen(4)
    server.write(9 + SLOTS, 1)  # a later load of the same slot
    assert client.read(9, LAYERS) is None and client.read(9 + SLOTS, LAYERS) == Seen(1)
    with pytest.raises(ValueError):
        client._words[0] = 1  # type: ignore[index]  # the client's mapping is read-only


def test_a_closed_page_reads_nothing_and_its_mapping_goes():
    client = ProgressPage.create()
    server = ProgressPage.open(client.path)
    client.unlink()
    client.unlink()  # twice: nothing to do
    path = client.path
    held = client._words  # a reader in the middle of a read keeps the mapping alive
    client.close()
    server.close()
    server.write(1, 1)  # after close: nothing written, no crash
    assert client.read(1, LAYERS) is None and client.closed
    assert _mapped(path)
    del held
    gc.collect()
    assert not _mapped(path)


def test_the_server_maps_only_a_fresh_page_file_of_its_user(tmp_path):
    name = PREFIX + "test-"
    target = tmp_path / (name + "target")
    target.write_bytes(b"\0" * PAGE_BYTES)
    ProgressPage.open(str(target)).close()  # the one kind of file it maps
    link = tmp_path / (name + "link")
    link.symlink_to(target)
    with pytest.raises(PageError, match="cannot open"):
        ProgressPage.open(str(link))  # never through a symlink
    short = tmp_path / (name + "short")
    short.write_bytes(b"\0" * 8)
    with pytest.raises(PageError, match="4096 bytes"):
        ProgressPage.open(str(short))
    fifo = tmp_path / (name + "fifo")
    os.mkfifo(fifo)
    with pytest.raises(PageError, match="regular file"):
        ProgressPage.open(str(fifo))
    with pytest.raises(PageError, match="cannot open"):
        ProgressPage.open(str(tmp_path / (name + "missing")))
    used = tmp_path / (name + "used")  # e.g. some other 4 KiB file of the server's user
    used.write_bytes(b"x" * PAGE_BYTES)
    with pytest.raises(PageError, match="not a fresh"):
        ProgressPage.open(str(used))
    assert used.read_bytes() == b"x" * PAGE_BYTES  # untouched
    other = tmp_path / "settings.bin"
    other.write_bytes(b"\0" * PAGE_BYTES)
    with pytest.raises(PageError, match="not named"):
        ProgressPage.open(str(other))


def test_a_page_is_served_for_cuda_pools_with_layer_events_on_ipc_servers_only(caplog):
    client = ProgressPage.create()
    try:
        desc = p.CudaIpcPool(b"\0" * 64, 0, 1, "gpu", layer_events=(b"",) * LAYERS, progress_page=client.path)
        page = serve_page(desc, allow_shm=True)
        assert page is not None
        page.close()
        assert serve_page(desc, allow_shm=False) is None  # over TCP the server maps no files
        assert serve_page(p.CudaIpcPool(b"\0" * 64, 0, 1, "gpu", progress_page=client.path), True) is None
        assert serve_page(p.ShmPool("/dev/shm/x"), True) is None
        caplog.set_level(logging.WARNING, logger="kvdepot")
        missing = p.CudaIpcPool(b"\0" * 64, 0, 1, "gpu", layer_events=(b"",), progress_page="/nonexistent/page")
        assert serve_page(missing, True) is None  # logged: the client's loads then go by LAYERS
        assert "by LAYERS" in caplog.text
    finally:
        client.unlink()
        client.close()


def test_old_peers_decode_the_new_fields_and_new_peers_the_old_messages():
    import msgspec

    class OldCudaIpcPool(msgspec.Struct, frozen=True, tag="cuda"):
        mem_handle: bytes
        offset: int
        alloc_bytes: int
        device_uuid: str

    new = p.CudaIpcPool(b"h", 1, 2, "u", progress_page="/dev/shm/x")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldCudaIpcPool).device_uuid == "u"
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(OldCudaIpcPool(b"h", 1, 2, "u")), type=p.CudaIpcPool)
    assert old.progress_page == ""
    reply = p.RegisterReply(256, "xxh3_128", 1, 0, b"d", "g")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=p.RegisterReply).progress_page is False


# ---- the server writes after recording ---------------------------------------------------------
def test_each_word_follows_the_records_it_counts(pages):
    client, server = pages
    seen_at_record: list[tuple[int, Seen | None]] = []

    def record(layer: int) -> None:  # the load records the layer's event as it enqueues the layer
        seen_at_record.append((layer, client.read(1, LAYERS)))  # what a client could read meanwhile

    load = ScriptedLoad([], on_layer=record)
    progress = LayerProgress(1, LAYERS, page=server)
    issuer = LayerIssuer("test-layers")
    try:
        start_early(load, progress, issuer, lambda layer: None, None, lambda: None)
        assert issuer.drain(5)
    finally:
        issuer.close()
    assert [layer for layer, _ in seen_at_record] == list(range(LAYERS))
    assert all(seen is not None and seen.recorded == layer for layer, seen in seen_at_record)  # never ahead
    assert client.read(1, LAYERS) == Seen(LAYERS)


@pytest.mark.parametrize(("fail_at", "deadline", "failure"), [(5, False, 1), (None, True, 2)])
def test_a_failure_is_written_after_the_fence(pages, fail_at, deadline, failure):
    client, server = pages
    log: list = []
    load = ScriptedLoad(log, fail_at=fail_at, hold_at=3 if deadline else None)
    progress = LayerProgress(1, LAYERS, time.monotonic_ns() + 60_000_000_000, page=server)
    words: list = []
    issuer = LayerIssuer("test-layers")
    try:
        start_early(load, progress, issuer, lambda layer: words.append(client.read(1, LAYERS)), None, lambda: None)
        if deadline:
            assert load.held.wait(5)
            progress.deadline_ns = time.monotonic_ns() - 1
            load.gate.set()
        assert issuer.drain(5)
    finally:
        issuer.close()
    stop = 5 if fail_at else 4
    assert words == [Seen(stop)] * (LAYERS - stop)  # the fence's records (the only ones made here): no failure shown yet
    assert client.read(1, LAYERS) == Seen(stop, failure, True)


# ---- the client reads it ---------------------------------------------------------------------------
def _asking(progress: LayerProgress | None, pool: ThreadPoolExecutor | None, asked: list[int]):
    def ask(through: int) -> Future:
        asked.append(through)
        if progress is None or pool is None:
            future: Future = Future()
            future.set_exception(ServerUnavailable("no reply from the server within 0.1 s"))
            return future
        return pool.submit(lambda: (p.LayersReply(*progress.wait_past(through, 2.0)), []))

    return ask


def test_the_wait_reads_the_page_and_asks_nothing(pages):
    client, server = pages
    log: list = []
    load = ScriptedLoad(log, hold_at=5)
    issuer = LayerIssuer("test-layers")
    asked: list[int] = []
    stats = FollowStats()
    with ThreadPoolExecutor(2) as pool:
        try:
            progress = LayerProgress(3, LAYERS, page=server)
            start_early(load, progress, issuer, lambda layer: None, None, lambda: None)
            watch = Watch(client, 3, time.monotonic_ns() + 10_000_000_000)
            follow = RemoteProgress(_asking(progress, pool, asked), progress.recorded, LAYERS, 2.0, watch, stats)
            follow.through(4)
            waiting = pool.submit(follow.through, 6)
            time.sleep(0.05)
            assert not waiting.done()  # layer 5 is held on the server: the wait must not pass it
            load.gate.set()
            waiting.result(5)
            follow.through(LAYERS - 1)
        finally:
            load.gate.set()
            issuer.close()
    assert asked == [] and stats == FollowStats(loads=1, asks=0, fallbacks=0)


@pytest.mark.parametrize(("failure", "fenced", "kind", "text"), [
    (1, True, FencedFailure, "could not be enqueued"),
    (2, True, FencedFailure, "deadline passed"),
    (3, False, TransferFailed, "could not signal"),
])
def test_a_failure_on_the_page_fails_that_layer_and_every_later_one(pages, failure, fenced, kind, text):
    client, server = pages
    server.write(4, 3, failure, fenced)
    follow = RemoteProgress(_asking(None, None, []), 1, LAYERS, 0.1, Watch(client, 4, time.monotonic_ns() + 10**10))
    follow.through(2)  # recorded before the failure: valid
    for layer in (3, LAYERS - 1):
        with pytest.raises(kind, match=f"after 3 layers: .*{text}") as raised:
            follow.through(layer)
        assert fenced or not isinstance(raised.value, FencedFailure)
    assert follow.stats.asks == 0


def test_a_slot_taken_by_a_later_load_falls_back_to_layers(pages):
    client, server = pages
    progress = LayerProgress(4, LAYERS)
    progress.advance(LAYERS)
    server.write(4 + SLOTS, 2)  # a later load took the slot
    asked: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        follow = RemoteProgress(_asking(progress, pool, asked), 1, LAYERS, 1.0, Watch(client, 4, time.monotonic_ns() + 10**10))
        follow.through(LAYERS - 1)
    assert asked == [LAYERS - 1] and follow.stats.fallbacks == 1  # LAYERS answered, and the wait went on


def test_a_silent_page_past_the_deadline_asks_layers_and_a_gone_server_fails(pages):
    client, _server = pages
    asked: list[int] = []
    follow = RemoteProgress(_asking(None, None, asked), 1, LAYERS, 0.1, Watch(client, 4, time.monotonic_ns() + 50_000_000))
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="ServerUnavailable") as raised:
        follow.through(1)
    assert 0.04 < time.monotonic() - started < 5.0  # the page was read until the deadline, then LAYERS
    assert not isinstance(raised.value, FencedFailure) and asked == [1]
    with pytest.raises(TransferFailed):
        follow.through(LAYERS - 1)


def test_a_session_gone_stops_reading_the_page_at_once(pages):
    client, server = pages
    server.write(4, 2)
    asked: list[int] = []
    alive = [True]
    watch = Watch(client, 4, time.monotonic_ns() + 10**11, lambda: alive[0])  # a deadline far off
    follow = RemoteProgress(_asking(None, None, asked), 1, LAYERS, 0.1, watch)
    follow.through(1)  # recorded: valid whatever happens next
    alive[0] = False  # the server restarted, or the client registered again elsewhere
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="ServerUnavailable"):
        follow.through(2)
    assert time.monotonic() - started < 2.0 and asked == [2]


def test_the_page_serves_a_real_servers_follower(pages):
    """The server side as the service runs it (``_client`` answers LAYERS from the progress), the
    page written too: the follower reads the page and never asks."""
    client, server = pages
    log: list = []
    load = ScriptedLoad(log, hold_at=0)
    issuer = LayerIssuer("test-layers")
    with ThreadPoolExecutor(2) as pool:
        try:
            progress = LayerProgress(11, LAYERS, page=server)
            start_early(load, progress, issuer, lambda layer: None, None, lambda: None)
            assert load.held.wait(5) and progress.recorded == 0  # with a page: answered before layer 0
            follow = _client(progress, pool)
            assert follow.asked == [0]  # without a page: one LAYERS call ahead from the start
            paged = RemoteProgress(lambda through: pool.submit(lambda: None), progress.recorded, LAYERS, 2.0,
                                   Watch(client, 11, time.monotonic_ns() + 10**10))
            load.gate.set()
            paged.through(LAYERS - 1)
            assert paged.stats.asks == 0
        finally:
            load.gate.set()
            issuer.close()
