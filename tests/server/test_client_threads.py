"""The shared socket without hand-offs: callers send and read it themselves, from many threads;
the server answers cheap requests on its loop thread unless that could block."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest
import zmq
from client_proc import BLOCKS, prompt
from mp_helpers import TOKENS_PER_BLOCK, make_pool, wait_for

from kvdepot.config import load_config
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient, ServerUnavailable
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer
from kvdepot.server.service import DepotService

pytestmark = pytest.mark.timeout(60)

CONFIG = {"chunk_size": 16, "host_capacity_gb": 0.01}


@pytest.fixture
def served(workdir):
    """An in-process server, a client and a registered shared-file pool holding one prompt."""
    server = DepotServer(f"ipc://{workdir}/t.sock", load_config(**CONFIG)).start()
    client = DepotClient(server.url, timeout_s=5.0, heartbeat_s=0.5, name="threads")  # its PINGs wait 0.5 s
    engine = RemoteEngine(client, make_pool("shm", workdir, seed=3), TOKENS_PER_BLOCK, model_id="threads", mode="shm")
    keys = engine.chunk_keys(prompt(3))
    engine.store(keys, list(range(BLOCKS))).wait()
    yield server, client, engine, keys
    client.close()
    server.stop()


def test_many_threads_share_one_client(served, caplog):
    """Every thread gets its own replies whoever drained them; nothing is lost or left behind."""
    _server, client, engine, keys = served
    caplog.set_level(logging.WARNING, logger="kvdepot")
    blob, errors, worst = w.join_keys(keys), [], [0.0]

    def work(t: int) -> None:
        try:
            for i in range(150):
                rid = t * 1000 + i
                started = time.monotonic()
                status, _ = client.call(p.Lookup(rid, blob))
                assert status.matched_tokens == len(keys) * 16, status
                client.submit(p.Release(rid))  # fire and forget
                pong, _ = client.submit(p.Ping()).result()
                assert pong.server_id == client.server_id
                future = client.submit(p.QueryPrefetch(rid))
                while not future.done():  # done() drains too: no thread has to wait for it
                    time.sleep(0.0001)
                worst[0] = max(worst[0], time.monotonic() - started)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not errors, errors[:3]
    assert worst[0] < 2.0, worst  # a reply drained by another thread wakes its waiter at once
    assert wait_for(lambda: not client._calls, timeout=2)  # fire-and-forget replies collected
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert engine.lookup(keys, lease=1) == len(keys) * 16


def test_a_reply_nobody_asks_for_is_collected(served):
    _server, client, _engine, _keys = served
    future = client.submit(p.Ping())
    # Future.done: the base class's, which reads nothing; the I/O thread settles it on its tick.
    assert wait_for(lambda: Future.done(future), timeout=1.0, interval=0.01)
    assert future.result()[0].server_id == client.server_id


def test_loop_answers_while_an_engine_is_busy(served):
    """A LOOKUP that would wait for a busy engine goes to the pool; PING is answered meanwhile."""
    server, client, engine, keys = served
    shard = next(iter(server.service._groups.values())).shards[0]
    shard.engine._lock.acquire()  # e.g. a pool swap waiting for copies
    try:
        lookup = client.submit(p.Lookup(5, w.join_keys(keys)))
        started = time.monotonic()
        for _ in range(20):
            client.call(p.Ping())
        assert time.monotonic() - started < 2.0
        time.sleep(0.05)
        assert not lookup.done()  # waiting on the pool, not on the loop thread
    finally:
        shard.engine._lock.release()
    assert lookup.result()[0].matched_tokens == len(keys) * 16
    client.call(p.Release(5))


def _service(workdir, **extra):
    service = DepotService(load_config(**CONFIG, **extra), url=f"ipc://{workdir}/none.sock")
    peer = b"peer"
    service.handle(peer, w.request_frames(p.Op.HELLO, 1, p.Hello(p.PROTOCOL_VERSION)))
    pool = make_pool("shm", workdir, seed=4)
    storage = pool.untyped_storage()
    msg = p.Register("svc", 0, 1, TOKENS_PER_BLOCK, pool.shape[0], pool.shape[1], pool.shape[2], pool.shape[3],
                     "bfloat16", pool[0].numel() * 2, p.ShmPool(storage.filename, pool.data_ptr() - storage.data_ptr()))
    assert w.parse_reply_header(service.handle(peer, w.request_frames(p.Op.REGISTER, 2, msg))[0]).status == 0
    group = next(iter(service._groups.values()))
    keys = group.hasher.chunk_keys(prompt(4))
    service.handle(peer, w.request_frames(p.Op.STORE, 3, p.Store(w.join_keys(keys), list(range(BLOCKS)))))
    return service, peer, group, keys


def _inline(service, peer, op, msg):
    header, spec, body, payloads = w.parse_request(w.request_frames(op, 9, msg))
    return service.try_inline(peer, header.req_id, spec, body, payloads)


def test_lookup_and_release_run_inline_only_when_they_cannot_block(workdir):
    service, peer, group, keys = _service(workdir)
    engine = group.shards[0].engine
    try:
        reply = _inline(service, peer, p.Op.LOOKUP, p.Lookup(1, w.join_keys(keys)))
        assert w.decode(reply[1], p.PrefetchStatus) == p.PrefetchStatus(True, 5 * 16, 5 * 16)
        assert engine.host.live_leases == 1
        assert _inline(service, peer, p.Op.LOOKUP, p.Lookup(2, b"", prompt(4))) is None  # hashing: pool
        holder_in, holder_out = threading.Event(), threading.Event()

        def hold() -> None:  # another thread: the engine's lock is re-entrant for this one
            with engine._lock:
                holder_in.set()
                holder_out.wait(10)

        thread = threading.Thread(target=hold)
        thread.start()
        holder_in.wait(10)
        assert _inline(service, peer, p.Op.LOOKUP, p.Lookup(3, w.join_keys(keys))) is None
        assert _inline(service, peer, p.Op.RELEASE, p.Release(1)) is None
        assert engine.host.live_leases == 1  # nothing was done by the refused attempts
        holder_out.set()
        thread.join(10)
        assert w.parse_reply_header(_inline(service, peer, p.Op.RELEASE, p.Release(1))[0]).status == 0
        assert engine.host.live_leases == 0
        # Errors are answered inline too (cheap), e.g. a ragged keys field.
        reply = _inline(service, peer, p.Op.LOOKUP, p.Lookup(4, b"x" * 17))
        assert w.parse_reply_header(reply[0]).status == p.ErrorCode.BAD_REQUEST
    finally:
        service.close()


def test_lookup_with_a_lower_tier_stays_off_the_loop(workdir):
    service, peer, _group, keys = _service(workdir, disk_path=str(workdir / "disk"), disk_capacity_gb=0.01)
    try:
        assert _inline(service, peer, p.Op.LOOKUP, p.Lookup(1, w.join_keys(keys))) is None  # disk may wait on I/O
        assert _inline(service, peer, p.Op.PING, p.Ping()) is not None
    finally:
        service.close()


def test_late_reply_is_dropped(workdir):
    """A fake server answers a PING after the caller gave up; the reply is dropped, and the
    calls after the reconnect get their own replies."""
    url = f"ipc://{workdir}/fake.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(url)
    held: list[list[bytes]] = []
    stop, first_ping = threading.Event(), threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            peer, header, body = router.recv_multipart()[:3]
            req = w.parse_request([header, body])[0]
            if req.op == p.Op.HELLO:
                reply = p.HelloReply(p.PROTOCOL_VERSION, 1, 77, 1)
            elif req.op == p.Op.PING and not first_ping.is_set():
                first_ping.set()
                held.append([peer, *w.reply_frames(req.req_id, p.Pong(77, 0))])  # answered late
                continue
            else:
                reply = p.Pong(77, req.req_id)
            router.send_multipart([peer, *w.reply_frames(req.req_id, reply)])
            if held and req.op == p.Op.HELLO:  # the client reconnected: now send the stale reply
                router.send_multipart(held.pop())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = DepotClient(url, timeout_s=0.3, heartbeat_s=3600, name="late")
    try:
        assert client.ready
        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.call(p.Ping())
        assert time.monotonic() - started < 1.0
        assert client.connect()  # HELLO again (unless the keeper did); the server then sends the stale reply
        assert wait_for(lambda: not held, timeout=5)
        for _ in range(5):
            pong, _ = client.call(p.Ping())
            assert pong.server_id == 77 and pong.time_ns > 0  # this call's own reply, not the stale one
    finally:
        client.close()
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()
