"""A real server subprocess and real clients: registration, bit-exact copies, lookups, sharing."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from client_proc import BLOCKS, prompt
from mp_helpers import (
    CHUNK,
    DTYPE,
    POOL_SHAPE,
    TOKENS_PER_BLOCK,
    fill,
    make_pool,
    run_client,
    start_server,
    stats,
    stop_server,
    totals,
    wait_for,
)

from kvdepot.config import load_config
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient, ServerError
from kvdepot.server.paths import tcp_url
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer, ServerAlreadyRunning
from kvdepot.server.stats_cmd import print_stats

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(server_url):
    c = DepotClient(server_url, timeout_s=5.0, heartbeat_s=0.2, name="test")
    yield c
    c.close()


def remote(client, pool, model, mode, **kw) -> RemoteEngine:
    engine = RemoteEngine(client, pool, TOKENS_PER_BLOCK, model_id=model, mode=mode, **kw)
    assert engine.ready
    return engine


@pytest.mark.parametrize("mode", ["shm", "bytes"])
def test_store_then_retrieve_is_bit_exact(server_url, client, workdir, mode):
    pool = make_pool(mode, workdir, seed=1)
    engine = remote(client, pool, f"exact-{mode}", mode)
    assert engine.granted.chunk_size == CHUNK and engine.granted.host_blocks > 0
    tokens = prompt(1)
    keys = engine.chunk_keys(tokens)
    assert engine.lookup(keys, lease=1) == 0
    handle = engine.store(keys, list(range(BLOCKS)))
    handle.wait()
    assert handle.chunks == len(keys) == 5
    assert engine.lookup(keys, lease=2) == 5 * CHUNK
    expected = pool[:BLOCKS].clone()
    dst = list(range(16, 16 + BLOCKS))
    assert engine.retrieve(keys, dst, lease=2) == 5 * CHUNK
    assert torch.equal(pool[dst], expected)
    # A load that starts inside a chunk writes exactly the blocks asked for, nothing else.
    pool[dst] = 0
    assert engine.retrieve(keys, dst, skip_blocks=3, num_blocks=4) == 7 * TOKENS_PER_BLOCK
    assert torch.equal(pool[dst[3:7]], expected[3:7])
    assert not pool[dst[:3]].any() and not pool[dst[7:]].any()
    engine.release(2)
    engine.close()


def test_a_load_asked_by_layer_of_a_pool_without_layer_events_is_whole(server_url, client, workdir):
    """The server copies by layer only where the pool registered an event per layer (CUDA IPC);
    asked anyway, it loads whole, says so, and the client waits for the whole load as usual."""
    pool = make_pool("shm", workdir, seed=5)
    engine = remote(client, pool, "by-layer-shm", "shm")
    keys = engine.chunk_keys(prompt(5))
    engine.store(keys, list(range(BLOCKS))).wait()
    expected = pool[:BLOCKS].clone()
    dst = list(range(16, 16 + BLOCKS))
    engine.exported._layer_events = [object()]  # pretend: the client believes it can ask
    assert engine.exported.layered
    assert engine.lookup(keys, lease=3) == 5 * CHUNK
    sent, submit = [], engine.client.submit
    engine.client.submit = lambda msg, **kw: sent.append(msg) or submit(msg, **kw)
    handle = engine.retrieve_async(keys, dst, lease=3, by_layer=True)
    assert handle.result() == 5 * CHUNK and handle.layered is None
    assert [m.by_layer for m in sent] == [True]  # asked, and answered whole
    engine.client.submit = submit
    assert torch.equal(pool[dst], expected)
    engine.exported._layer_events = []
    engine.close()


def test_lookup_starts_a_prefetch_and_status_is_queryable(server_url, client, workdir):
    engine = remote(client, make_pool("shm", workdir, seed=2), "prefetch", "shm")
    keys = engine.chunk_keys(prompt(2))
    engine.store(keys, list(range(BLOCKS))).wait()
    status, _ = client.call(p.Lookup(11, w.join_keys(keys[:3])))
    assert status == p.PrefetchStatus(True, 3 * CHUNK, 3 * CHUNK, status.lease_token)
    assert len(status.lease_token) == 16  # LOOKUP hands out the session's lease token; the status query does not
    assert client.call(p.QueryPrefetch(11))[0] == p.PrefetchStatus(True, 3 * CHUNK, 3 * CHUNK)
    figures = totals(stats(client))
    assert figures["live_leases"] >= 1 and figures["pinned_chunks"] >= 3
    client.call(p.Release(11))
    with pytest.raises(ServerError) as info:
        client.call(p.QueryPrefetch(11))
    assert info.value.code == p.ErrorCode.UNKNOWN_REQUEST
    # Lookups by tokens hash on the server with the same rank-free keys.
    status, _ = client.call(p.Lookup(12, b"", prompt(2), CHUNK))
    assert status.matched_tokens == 5 * CHUNK
    client.call(p.Release(12))
    assert totals(stats(client))["live_leases"] == 0


def test_two_client_processes_share_one_server(server_url, client, workdir):
    """Another process stores (shared-file pool) and exits; this process hits (bytes pool)."""
    stored = run_client("store", server_url, str(workdir), "3", "shared")
    assert stored.returncode == 0, stored.stderr
    assert "stored 5" in stored.stdout
    pool = torch.zeros(POOL_SHAPE, dtype=DTYPE)
    engine = remote(client, pool, "shared", "bytes")
    keys = engine.chunk_keys(prompt(3))
    assert engine.lookup(keys, lease=1) == 5 * CHUNK
    dst = list(range(BLOCKS, 2 * BLOCKS))
    assert engine.retrieve(keys, dst, lease=1) == 5 * CHUNK
    assert torch.equal(pool[dst], make_pool("bytes", workdir, seed=3)[:BLOCKS])


def test_tensor_parallel_hit_needs_every_rank(server_url, workdir):
    clients = [DepotClient(server_url, timeout_s=5.0, heartbeat_s=0.2) for _ in range(2)]
    try:
        pools = [make_pool("shm", workdir, seed=10 + r, name=f"tp{r}") for r in range(2)]
        ranks = [remote(clients[r], pools[r], "tp-model", "shm", tp_rank=r, tp_size=2) for r in range(2)]
        keys = ranks[0].chunk_keys(prompt(4))
        assert keys == ranks[1].chunk_keys(prompt(4))  # rank-free keys
        ranks[0].store(keys, list(range(BLOCKS))).wait()
        assert ranks[0].lookup(keys, lease=1) == 0  # rank 1 lacks every chunk
        ranks[1].store(keys[:2], list(range(BLOCKS // 2))).wait()
        assert ranks[0].lookup(keys, lease=1) == 2 * CHUNK  # both hold 2 chunks
        ranks[1].store(keys, list(range(BLOCKS))).wait()
        assert ranks[0].lookup(keys, lease=1) == 5 * CHUNK
        expected = [pool[:BLOCKS].clone() for pool in pools]
        dst = list(range(20, 20 + BLOCKS))
        for r in range(2):  # each rank loads its own shard, under the scheduler's lease
            lease = ranks[0].handover(1)  # the scheduler's session and its token
            assert ranks[r].retrieve(keys, dst, lease=lease) == 5 * CHUNK
            assert torch.equal(pools[r][dst], expected[r])
    finally:
        for c in clients:
            c.close()


def test_other_geometry_for_the_same_model_is_refused(server_url, client, workdir):
    remote(client, make_pool("bytes", workdir), "geo", "bytes")
    other = DepotClient(server_url, timeout_s=5.0)
    try:
        wide = torch.zeros((8, 2, 2, 2 * POOL_SHAPE[3]), dtype=DTYPE)
        engine = RemoteEngine(other, wide, TOKENS_PER_BLOCK, model_id="geo", mode="bytes")
        assert not engine.ready
        msg = p.Register("geo", 0, 1, TOKENS_PER_BLOCK, 8, 2, 2, 2 * POOL_SHAPE[3], "bfloat16",
                         2 * 2 * 2 * POOL_SHAPE[3] * 2, p.BytesPool())
        with pytest.raises(ServerError) as info:
            other.call(msg, handshake=True)
        assert info.value.code == p.ErrorCode.GEOMETRY_MISMATCH
        assert "'geo'" in info.value.message and "must agree" in info.value.message
    finally:
        other.close()


@pytest.mark.parametrize(("layers", "count"), [(2, 1), (2, 3), (2, 2000), (1100, 1100)])
def test_a_pool_with_layer_events_not_one_per_layer_is_refused(client, layers, count):
    """A REGISTER naming layer events must name one per layer, at most 1024: anything else is
    refused by name before the server opens a handle (a CUDA one here, on a machine without)."""
    pool = p.CudaIpcPool(b"h" * 64, 0, 1 << 40, "GPU-x", b"e" * 64, b"f" * 64, (b"l" * 64,) * count)
    msg = p.Register(f"layer-events-{layers}", 0, 1, TOKENS_PER_BLOCK, POOL_SHAPE[0], layers, 2, POOL_SHAPE[3],
                     "bfloat16", layers * 2 * POOL_SHAPE[3] * 2, pool)
    with pytest.raises(ServerError) as info:
        client.call(msg)
    assert info.value.code == p.ErrorCode.BAD_REQUEST
    assert f"{count} layer events for {layers} layers" in info.value.message and "up to 1024" in info.value.message


def test_client_with_another_protocol_version_gets_a_clear_error(server_url):
    raw = DepotClient(server_url, timeout_s=5.0, connect=False)
    try:
        with pytest.raises(ServerError) as info:
            raw.call(p.Hello(p.PROTOCOL_VERSION + 5, "future"), handshake=True)
        assert info.value.code == p.ErrorCode.VERSION_MISMATCH
        assert "same kvdepot version" in info.value.message
    finally:
        raw.close()


def test_second_server_on_the_same_url_fails_clearly(server_url):
    result = subprocess.run([sys.executable, "-m", "kvdepot.server", "--url", server_url],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "already serving" in result.stderr and server_url in result.stderr
    with pytest.raises(ServerAlreadyRunning, match="already serving"):
        DepotServer(server_url, load_config(chunk_size=CHUNK, host_capacity_gb=0.01)).start()


def test_sigterm_stops_cleanly_and_removes_the_socket(workdir):
    url = f"ipc://{workdir}/term.sock"
    proc = start_server(url)
    assert os.stat(f"{workdir}/term.sock").st_mode & 0o077 == 0  # owner-only socket
    assert stop_server(proc) == 0
    assert not os.path.exists(f"{workdir}/term.sock")


def test_stats_printer(server_url, client, workdir):
    engine = remote(client, make_pool("bytes", workdir), "stats-model", "bytes")
    engine.store(engine.chunk_keys(prompt(5)), list(range(BLOCKS))).wait()
    out = io.StringIO()
    assert print_stats(server_url, file=out) == 0
    text = out.getvalue()
    assert "stats-model rank 0: 5/" in text and "clients" in text
    assert print_stats(f"ipc://{workdir}/none.sock", timeout_s=0.3) == 1


def test_prometheus_endpoint(workdir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = load_config(chunk_size=CHUNK, host_capacity_gb=0.01)
    with DepotServer(f"ipc://{workdir}/m.sock", config, metrics_port=port) as server:
        c = DepotClient(server.url, timeout_s=5.0)
        try:
            engine = remote(c, fill(torch.zeros(POOL_SHAPE, dtype=DTYPE), 0), "metrics", "bytes")
            keys = engine.chunk_keys(prompt(6))
            engine.store(keys, list(range(BLOCKS))).wait()
            engine.lookup(keys, lease=1)
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        finally:
            c.close()
    assert 'kvdepot_hits_total{model="metrics",rank="0"} 5.0' in body
    assert "kvdepot_clients 1.0" in body and "kvdepot_store_gbps" in body and "kvdepot_live_leases" in body
    assert 'kvdepot_refused_batches_total{model="metrics",rank="0"} 0.0' in body


def test_copy_past_its_deadline_is_refused(server_url, client, workdir):
    engine = remote(client, make_pool("shm", workdir, seed=8), "deadline", "shm")
    keys = engine.chunk_keys(prompt(8))
    late = p.Store(w.join_keys(keys), list(range(BLOCKS)), deadline_ns=time.monotonic_ns() - 1)
    with pytest.raises(ServerError) as info:
        client.call(late)
    assert info.value.code == p.ErrorCode.DEADLINE_EXCEEDED
    assert engine.lookup(keys, lease=1) == 0  # nothing was stored


def test_tcp_server_maps_no_files_and_the_client_falls_back_to_bytes(workdir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = load_config(chunk_size=CHUNK, host_capacity_gb=0.01)
    with DepotServer(tcp_url(port), config, insecure=True) as server:
        assert server.url == f"tcp://127.0.0.1:{port}"
        c = DepotClient(server.url, timeout_s=5.0)
        try:
            pool = make_pool("shm", workdir, seed=9)
            engine = RemoteEngine(c, pool, TOKENS_PER_BLOCK, model_id="tcp", mode="auto")
            assert engine.ready and engine.exported.kind == "bytes"  # refused as shm, re-registered
            keys = engine.chunk_keys(prompt(9))
            engine.store(keys, list(range(BLOCKS))).wait()
            dst = list(range(16, 16 + BLOCKS))
            assert engine.retrieve(keys, dst) == 5 * CHUNK
            assert torch.equal(pool[dst], pool[:BLOCKS])
        finally:
            c.close()


def _written_and_unpinned(client, chunks: int) -> bool:
    """At least ``chunks`` on disk, and no host slot pinned (write-behind lends each while it writes)."""
    figures = totals(stats(client))
    return figures.get("disk_chunks", 0) >= chunks and figures["pinned_chunks"] == 0


def test_prefetch_from_disk_is_pending_until_promoted(workdir):
    chunk_bytes = 2 * 2 * 2 * POOL_SHAPE[3] * 2
    config = load_config(chunk_size=CHUNK, host_capacity_gb=(5 * chunk_bytes + 64) / 1e9,
                         disk_path=str(workdir / "disk"), disk_capacity_gb=0.01)
    with DepotServer(f"ipc://{workdir}/p.sock", config) as server:
        c = DepotClient(server.url, timeout_s=5.0)
        try:
            pool = make_pool("shm", workdir, seed=12)
            engine = remote(c, pool, "tiers", "shm")
            keys, later = engine.chunk_keys(prompt(12)), engine.chunk_keys(prompt(13))
            engine.store(keys, list(range(BLOCKS))).wait()
            assert wait_for(lambda: totals(stats(c)).get("disk_chunks", 0) >= 5, 10)  # write-behind
            engine.store(later, list(range(BLOCKS, 2 * BLOCKS))).wait()  # evicts `keys`
            # Write-behind of `later` pins each slot while the disk writes it; with 5 slots a
            # promotion meeting one pinned stops short (and then reports fewer tokens ready): let it
            # finish first (written, and the last slot given back).
            assert wait_for(lambda: _written_and_unpinned(c, 10), 10)
            status, _ = c.call(p.Lookup(21, w.join_keys(keys)))
            assert status.matched_tokens == 5 * CHUNK and status.ready_tokens == 0 and not status.done
            assert wait_for(lambda: c.call(p.QueryPrefetch(21))[0].done, 10)
            assert c.call(p.QueryPrefetch(21))[0] == p.PrefetchStatus(True, 5 * CHUNK, 5 * CHUNK)
            dst = list(range(20, 20 + BLOCKS))
            assert engine.retrieve(keys, dst, lease=21) == 5 * CHUNK
            assert torch.equal(pool[dst], pool[:BLOCKS])
            c.call(p.Release(21))
            assert totals(stats(c))["live_leases"] == 0
        finally:
            c.close()


def test_tensor_parallel_ranks_never_share_disk_objects(workdir):
    """Same rank-free keys on both ranks, different bytes: each rank gets its own back from disk."""
    chunk_bytes = 2 * 2 * 2 * POOL_SHAPE[3] * 2
    config = load_config(chunk_size=CHUNK, host_capacity_gb=2 * (5 * chunk_bytes + 64) / 1e9,
                         disk_path=str(workdir / "disk"), disk_capacity_gb=0.02)
    with DepotServer(f"ipc://{workdir}/tpd.sock", config) as server:
        clients = [DepotClient(server.url, timeout_s=5.0) for _ in range(2)]
        try:
            pools = [make_pool("shm", workdir, seed=30 + r, name=f"tpd{r}") for r in range(2)]
            ranks = [remote(clients[r], pools[r], "tp-disk", "shm", tp_rank=r, tp_size=2) for r in range(2)]
            assert ranks[0].granted.disk_blocks > 0
            keys, later = ranks[0].chunk_keys(prompt(30)), ranks[0].chunk_keys(prompt(31))
            for engine in ranks:
                engine.store(keys, list(range(BLOCKS))).wait()
            assert wait_for(lambda: totals(stats(clients[0])).get("disk_chunks", 0) >= 10, 10)
            for engine in ranks:  # push `keys` out of host memory on both ranks
                engine.store(later, list(range(BLOCKS, 2 * BLOCKS))).wait()
            # Let write-behind of `later` finish: it pins each host slot while the disk writes it,
            # and with 5 slots per rank a promotion that finds one pinned loads fewer chunks.
            assert wait_for(lambda: _written_and_unpinned(clients[0], 20), 10)
            status, _ = clients[0].call(p.Lookup(3, w.join_keys(keys)))
            assert status.matched_tokens == 5 * CHUNK and not status.done
            dst = list(range(20, 20 + BLOCKS))
            for r in range(2):
                lease = (clients[0].session_id, 3, status.lease_token)
                assert ranks[r].retrieve(keys, dst, lease=lease) == 5 * CHUNK
                assert torch.equal(pools[r][dst], pools[r][:BLOCKS]), f"rank {r} got another rank's bytes"
        finally:
            for c in clients:
                c.close()
