"""Real processes killed with -9: the client outlives the server, the server outlives clients."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from client_proc import BLOCKS, prompt
from mp_helpers import (
    CHUNK,
    DTYPE,
    POOL_SHAPE,
    TOKENS_PER_BLOCK,
    make_pool,
    spawn_client,
    start_server,
    stats,
    totals,
    wait_for,
)

from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

pytestmark = pytest.mark.timeout(90)

TIMEOUT_S = 0.5


def test_client_survives_a_killed_server_and_re_registers(workdir, caplog):
    url = f"ipc://{workdir}/f.sock"
    proc = start_server(url, "--session-timeout-s", "2")
    client = DepotClient(url, timeout_s=TIMEOUT_S, heartbeat_s=0.1, name="survivor")
    try:
        pool = make_pool("shm", workdir, seed=1)
        engine = RemoteEngine(client, pool, TOKENS_PER_BLOCK, model_id="fault", mode="shm")
        keys, ids, dst = engine.chunk_keys(prompt(1)), list(range(BLOCKS)), list(range(16, 16 + BLOCKS))
        engine.store(keys, ids).wait()
        assert engine.lookup(keys, lease=1) == 5 * CHUNK
        expected = pool[:BLOCKS].clone()

        caplog.set_level(logging.WARNING, logger="kvdepot")
        caplog.clear()
        proc.kill()
        proc.wait()
        worst = 0.0
        for i in range(20):  # every call answers, each within the timeout: misses, no store, no load
            started = time.monotonic()
            assert engine.lookup(keys, lease=10 + i) == 0
            handle = engine.store(keys, ids)
            handle.wait()
            assert handle.chunks == 0
            assert engine.retrieve(keys, dst) == 0
            worst = max(worst, time.monotonic() - started)
        assert worst < 3 * TIMEOUT_S + 0.5
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "unavailable" in warnings[0].getMessage()

        proc = start_server(url, "--session-timeout-s", "2")  # an empty cache, same URL
        assert wait_for(lambda: engine.ready, timeout=20)  # re-HELLO + re-REGISTER by itself
        assert engine.lookup(keys, lease=2) == 0
        engine.store(keys, ids).wait()
        assert engine.lookup(keys, lease=3) == 5 * CHUNK
        pool[dst] = 0
        assert engine.retrieve(keys, dst, lease=3) == 5 * CHUNK
        assert torch.equal(pool[dst], expected)
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    finally:
        client.close()
        proc.kill()
        proc.wait()


def test_killed_client_leases_and_mapping_are_released(server_url, workdir):
    observer = DepotClient(server_url, timeout_s=5.0, heartbeat_s=0.2, name="observer")
    holder = spawn_client("hold", server_url, str(workdir), "21", "held")
    try:
        survivor = RemoteEngine(observer, torch.zeros(POOL_SHAPE, dtype=DTYPE), TOKENS_PER_BLOCK,
                                model_id="survivor", mode="bytes")
        lines = [holder.stdout.readline().strip() for _ in range(3)]
        assert lines == ["stored 5", f"matched {5 * CHUNK}", "holding"]
        assert (workdir / "pool-21").exists()
        before = stats(observer)
        assert (before.sessions, before.mappings, before.prefetches) == (2, 1, 1)
        assert totals(before)["live_leases"] == 1 and totals(before)["pinned_chunks"] == 5

        holder.kill()  # SIGKILL: no END_SESSION, its heartbeats just stop
        holder.wait()

        def released() -> bool:
            s = stats(observer)
            t = totals(s)
            return (s.sessions, s.mappings, s.prefetches, t["live_leases"], t["pinned_chunks"]) == (1, 0, 0, 0, 0)

        assert wait_for(released, timeout=10)
        assert not (workdir / "pool-21").exists()  # its shared pool file went with its session
        # The server kept serving: the survivor stores and hits; the dead client's chunks stay cached.
        keys = survivor.chunk_keys(prompt(22))
        survivor.store(keys, list(range(BLOCKS))).wait()
        assert survivor.lookup(keys, lease=1) == 5 * CHUNK
        held = next(s for s in stats(observer).shards if s.group == "held")
        assert held.figures["host_chunks"] == 5
        assert held.figures["host_pending_chunks"] == 0  # a CPU pool's arena grows on demand
    finally:
        if holder.poll() is None:
            holder.kill()
        observer.close()


def test_a_server_killed_inside_a_load_frees_the_blocks_and_writes_nothing_after(workdir):
    """The server admitted a load and stalls before copying, past the client's timeout: the load
    does not return while the server may still write (``copy_fence``), and returns at the kill."""
    url = f"ipc://{workdir}/k.sock"
    proc = start_server(url, script=Path(__file__).with_name("stalling_server.py"))
    client = DepotClient(url, timeout_s=TIMEOUT_S, heartbeat_s=0.1, name="stalled")
    stall = Path(url.removeprefix("ipc://") + ".stall")
    try:
        pool = make_pool("shm", workdir, seed=2)
        engine = RemoteEngine(client, pool, TOKENS_PER_BLOCK, model_id="killed", mode="shm")
        keys, dst = engine.chunk_keys(prompt(2)), list(range(16, 16 + BLOCKS))
        engine.store(keys, list(range(BLOCKS))).wait()
        pool[dst] = -7.0
        stall.touch()
        with ThreadPoolExecutor(1) as pool_threads:
            load = pool_threads.submit(engine.retrieve, keys, dst, lease=None)
            time.sleep(4 * TIMEOUT_S)
            assert not load.done()  # timed out long ago, but the server is inside the copy
            proc.kill()
            killed = time.monotonic()
            assert load.result(5) == 0
            assert time.monotonic() - killed < 2.0  # its lock went with it
        proc.wait()
        time.sleep(0.2)
        assert (pool[dst] == -7.0).all()  # it died before copying; nothing came after either
    finally:
        stall.unlink(missing_ok=True)
        client.close()
        proc.kill()
        proc.wait()
