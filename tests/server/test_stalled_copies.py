"""A server that stalls inside a copy into or out of a worker's mapped pool, past the client's
timeout: the client must not take its blocks back while the server may still touch them
(``copy_fence``). Without the fence the load below is written into after ``retrieve`` returned,
and the store below saves the bytes the client wrote after its ``wait`` returned."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from client_proc import BLOCKS, prompt
from mp_helpers import CHUNK, TOKENS_PER_BLOCK, fill, make_pool

from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.server import copy_fence, shard
from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import MappedPool
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not copy_fence.SUPPORTED, reason="needs open-file-description locks (Linux)")]

TIMEOUT_S = 0.6  # the client's; its deadline is half of it
STALL_S = 1.5
LOAD_AT = 16  # loads go to blocks 16.., stores come from blocks 0..
SENTINEL = -7.0


class Stalls:
    """Where the in-process server sleeps, once: ``load``/``store`` inside the copy (between its
    admission and the copy itself), ``before`` ahead of the admission."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.lock = threading.Lock()

    def take(self, where: str) -> None:
        with self.lock:
            seconds = self.at.pop(where, 0.0)
        time.sleep(seconds)


@pytest.fixture
def stalls(monkeypatch):
    stalls = Stalls()
    load, store, wait_client = shard._load, CacheEngine.store, MappedPool.wait_client

    def stalled_load(*args, **kwargs):
        stalls.take("load")
        return load(*args, **kwargs)

    def stalled_store(self, *args, **kwargs):
        stalls.take("store")
        return store(self, *args, **kwargs)

    def stalled_wait(self, synced):
        stalls.take("before")
        return wait_client(self, synced)

    monkeypatch.setattr(shard, "_load", stalled_load)
    monkeypatch.setattr(CacheEngine, "store", stalled_store)
    monkeypatch.setattr(MappedPool, "wait_client", stalled_wait)
    return stalls


@pytest.fixture
def engine(workdir, stalls):
    config = load_config(chunk_size=CHUNK, host_capacity_gb=0.01)
    with DepotServer(f"ipc://{workdir}/s.sock", config) as server:
        client = DepotClient(server.url, timeout_s=TIMEOUT_S, heartbeat_s=0.2, name="stalled")
        try:
            engine = RemoteEngine(client, make_pool("shm", workdir, seed=3), TOKENS_PER_BLOCK,
                                  model_id="stalled", mode="shm")
            assert engine.ready and engine._fence is not None  # the server opened this registration's fence
            yield engine
            engine.close()
        finally:
            client.close()


def _load_blocks(engine: RemoteEngine) -> tuple[list, list[int], torch.Tensor]:
    keys = engine.chunk_keys(prompt(3))
    assert engine.store(keys, list(range(BLOCKS))).result() == BLOCKS // (CHUNK // TOKENS_PER_BLOCK)
    dst = list(range(LOAD_AT, LOAD_AT + BLOCKS))
    engine.pool[LOAD_AT:] = SENTINEL
    return keys, dst, engine.pool[:BLOCKS].clone()


def test_a_load_stalled_inside_its_copy_is_waited_for(engine, stalls):
    keys, dst, stored = _load_blocks(engine)
    stalls.at["load"] = STALL_S
    started = time.monotonic()
    end = engine.retrieve(keys, dst)
    elapsed = time.monotonic() - started
    after = engine.pool[LOAD_AT:].clone()
    assert end == 0  # the call timed out: the engine recomputes these tokens
    assert elapsed >= STALL_S - 0.1, elapsed  # ... but only once the server was out of the copy
    assert torch.equal(after[:BLOCKS], stored)  # the copy it finished before letting go
    time.sleep(0.5)
    assert torch.equal(engine.pool[LOAD_AT:], after)  # and nothing lands afterwards
    engine.pool[LOAD_AT:] = SENTINEL
    assert engine.retrieve(keys, dst) == BLOCKS * TOKENS_PER_BLOCK  # the server serves on
    assert torch.equal(engine.pool[LOAD_AT : LOAD_AT + BLOCKS], stored)
    assert engine._fence.unsettled == 0


def test_a_store_stalled_inside_its_copy_keeps_its_blocks_until_it_is_over(engine, stalls):
    keys = engine.chunk_keys(prompt(4))
    ids = list(range(BLOCKS))
    first = engine.pool[:BLOCKS].clone()
    stalls.at["store"] = STALL_S
    started = time.monotonic()
    handle = engine.store(keys, ids)
    time.sleep(TIMEOUT_S + 0.2)
    assert not handle.done()  # timed out, but the server is inside the copy: the blocks are not free
    handle.wait()
    assert time.monotonic() - started >= STALL_S - 0.1
    assert handle.chunks == 0  # the client does not know it was stored
    fill(engine.pool[:BLOCKS], seed=99)  # the engine reuses the blocks for another request
    engine.pool[LOAD_AT:] = SENTINEL
    loaded = engine.retrieve(keys, list(range(LOAD_AT, LOAD_AT + BLOCKS)))
    if loaded:  # what the server stored under these keys is what the blocks held during the copy
        assert torch.equal(engine.pool[LOAD_AT : LOAD_AT + loaded // TOKENS_PER_BLOCK], first[: loaded // TOKENS_PER_BLOCK])
    assert loaded == BLOCKS * TOKENS_PER_BLOCK
    assert engine._fence.unsettled == 0


@pytest.mark.parametrize("deadline", [True, False])
def test_a_copy_stalled_before_it_started_is_refused(engine, stalls, monkeypatch, deadline):
    """Refused by the deadline, or (no deadline sent) by the fence alone; either way the client
    has its blocks back at its timeout and nothing is ever written into them."""
    if not deadline:
        monkeypatch.setattr(RemoteEngine, "_deadline", lambda self: 0)
    keys, dst, _ = _load_blocks(engine)
    stalls.at["before"] = STALL_S
    started = time.monotonic()
    assert engine.retrieve(keys, dst) == 0
    assert time.monotonic() - started < STALL_S - 0.3  # not held: the server had not entered the copy
    time.sleep(STALL_S + 0.3)  # the server wakes up and refuses
    assert (engine.pool[LOAD_AT:] == SENTINEL).all()
    other = engine.chunk_keys(prompt(5))
    stalls.at["before"] = STALL_S
    assert engine.store(other, list(range(BLOCKS))).result() == 0
    time.sleep(STALL_S + 0.3)
    assert engine.lookup(other, lease=9) == 0  # nothing was stored late either
