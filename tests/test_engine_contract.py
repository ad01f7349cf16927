"""``engine_api.Engine``: one suite, run against every engine a connector can hold.

``local`` is a ``CacheEngine`` in this process; ``remote-shm`` and ``remote-bytes`` are a
``RemoteEngine`` registered with a real ``DepotServer`` (in this process, on an ipc socket) whose
pool the server maps (a shared file) or receives over the socket. Each test states one clause of
the contract in ``engine_api``'s docstring: what a probe counts and pins, which blocks a load
writes and what it answers, that stores of cached chunks copy nothing, that every lease comes
back to zero. A last test checks that both classes offer every member of the protocol with its
parameters, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine import CacheEngine
from kvdepot.engine_api import Capabilities, Engine, Hit, Lease
from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import shared_cpu_pool
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer

pytestmark = pytest.mark.timeout(60)

B = 8  # tokens per block
CHUNK = 16  # two blocks a chunk
BLOCKS = 32
SHAPE = (BLOCKS, 2, 2, 4 * B * 4)  # TensorRT-LLM's [blocks, layers, k|v, heads*tokens*dim], bf16
CONFIG = {"chunk_size": CHUNK, "host_capacity_gb": 0.01}


@dataclass
class Side:
    """One engine under test, its pool, and how to read its tiers' lease counts."""

    engine: Engine
    pool: torch.Tensor
    pins: Callable[[], tuple[int, int]]  # (live leases, pinned chunks) in the tiers

    def rows(self) -> torch.Tensor:
        return self.pool.view(torch.uint8).reshape(BLOCKS, -1).clone()

    def pins_become(self, expected: tuple[int, int], timeout: float = 5.0) -> tuple[int, int]:
        """The counts once they equal ``expected`` (a remote RELEASE is fire-and-forget: it lands
        a little later), or as they are when ``timeout`` has passed."""
        deadline = time.monotonic() + timeout
        while (now := self.pins()) != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return now


def _filled(pool: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool.view(torch.uint8).copy_(torch.randint(0, 256, pool.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    return pool


def _local(workdir: Path) -> Iterator[Side]:
    pool = _filled(torch.empty(SHAPE, dtype=torch.bfloat16), 1)
    engine = CacheEngine.for_pool(pool, B, config=DepotConfig(**CONFIG))

    def pins() -> tuple[int, int]:
        stats = engine.stats()
        return stats.live_leases, stats.pinned_chunks

    yield Side(engine, pool, pins)
    engine.close()


def _remote(workdir: Path, mode: str) -> Iterator[Side]:
    server = DepotServer(f"ipc://{workdir}/c.sock", load_config(**CONFIG)).start()
    client = DepotClient(server.url, timeout_s=5.0, heartbeat_s=0.5, name="contract")
    if mode == "shm":
        pool = shared_cpu_pool(str(workdir / "pool"), SHAPE, torch.bfloat16)
    else:
        pool = torch.empty(SHAPE, dtype=torch.bfloat16)
    engine = RemoteEngine(client, _filled(pool, 1), B, model_id=f"contract-{mode}", mode=mode)
    assert engine.ready

    def pins() -> tuple[int, int]:
        shards = server.service.snapshot().shards
        return (int(sum(s.figures["live_leases"] for s in shards)), int(sum(s.figures["pinned_chunks"] for s in shards)))

    yield Side(engine, pool, pins)
    engine.close()
    client.close()
    server.stop()


@pytest.fixture(params=["local", "remote-shm", "remote-bytes"])
def side(request: pytest.FixtureRequest) -> Iterator[Side]:
    workdir = Path(tempfile.mkdtemp(prefix="kvc-", dir="/tmp"))  # short: an ipc:// path has 108 bytes at most
    try:
        kind = request.param
        yield from (_local(workdir) if kind == "local" else _remote(workdir, kind.removeprefix("remote-")))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def prompt(seed: int, chunks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(chunks * CHUNK)]


# ---- probe / lookup ---------------------------------------------------------------------------


def test_a_miss_answers_nothing_and_pins_nothing(side: Side) -> None:
    keys = side.engine.chunk_keys(prompt(1, 3))
    assert side.engine.probe(keys, lease=Lease(1)) == Hit(0, 0)
    assert side.engine.lookup(keys) == 0
    assert side.pins_become((0, 0)) == (0, 0)


def test_probe_counts_the_cached_run_and_its_lease_pins_it_until_release(side: Side) -> None:
    e = side.engine
    keys = e.chunk_keys(prompt(2, 4))
    handle = e.store(keys[:3], list(range(6)))  # chunks 0..2; chunk 3 never stored
    handle.wait()
    assert handle.done() and handle.chunks == 3
    assert e.probe(keys) == Hit(3 * CHUNK, 3 * CHUNK)  # all in host memory: nothing pending
    assert e.lookup(keys, skip_tokens=CHUNK) == 3 * CHUNK  # counted from chunk 1, still ends at 3
    assert e.lookup(keys, skip_tokens=CHUNK + B) == 3 * CHUNK  # rounds down to its chunk
    assert side.pins_become((0, 0)) == (0, 0)  # no lease, nothing stays pinned
    assert e.lookup(keys, lease=Lease(7)) == 3 * CHUNK
    assert side.pins() == (1, 3)
    assert e.lookup(keys[:1], lease=Lease(7)) == CHUNK  # a new probe replaces the lease's pins
    assert side.pins() == (1, 1)
    assert e.promotion_done(Lease(7))  # no lower tier: nothing to wait for
    e.release(Lease(7))
    assert side.pins_become((0, 0)) == (0, 0)
    e.release(Lease(7))  # twice, and a lease never taken: harmless
    e.release(Lease(8))
    assert side.pins_become((0, 0)) == (0, 0)
    assert e.lookup(keys) == 3 * CHUNK  # releasing unpins, it does not drop


# ---- store / retrieve -------------------------------------------------------------------------


def test_a_load_puts_back_exactly_the_stored_bytes_and_releases_its_lease(side: Side) -> None:
    e = side.engine
    keys = e.chunk_keys(prompt(3, 4))
    src, dst = [9, 2, 14, 5, 0, 11, 7, 3], [30, 17, 25, 19, 28, 21, 16, 23]  # 4 chunks, any order
    original = side.rows()
    e.store(keys, src).wait()
    assert e.store(keys, src).chunks == 0  # already cached: nothing to copy
    assert e.lookup(keys, lease=Lease(3)) == 4 * CHUNK
    side.pool.view(torch.uint8).reshape(BLOCKS, -1)[dst] = 0
    before = side.rows()
    assert e.retrieve(keys, dst, lease=Lease(3)) == 4 * CHUNK
    after = side.rows()
    assert torch.equal(after[dst], original[src])  # bit-exact
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert torch.equal(after[untouched], before[untouched])  # nothing else written
    assert side.pins_become((0, 0)) == (0, 0)  # the load took the lease's pins with it


def test_a_load_writes_only_the_blocks_asked_for_and_stops_at_a_miss(side: Side) -> None:
    e = side.engine
    keys = e.chunk_keys(prompt(4, 4))
    src, dst = list(range(8)), list(range(16, 24))
    original = side.rows()
    e.store(keys[:2], src[:4]).wait()  # chunks 0, 1 cached; 2, 3 not
    rows = side.pool.view(torch.uint8).reshape(BLOCKS, -1)
    rows[dst] = 0
    # Blocks 1..2 only (the engine holds block 0; block 3 is the caller's): inside chunk 0 and 1.
    assert e.retrieve(keys, dst, skip_blocks=1, num_blocks=2) == 3 * B
    assert torch.equal(side.rows()[dst[1:3]], original[src[1:3]])
    assert not side.rows()[[dst[0], *dst[3:]]].any()
    rows[dst] = 0
    # The whole prompt asked for: the run ends at the first chunk not cached.
    assert e.retrieve(keys, dst, lease=Lease(4)) == 2 * CHUNK
    assert torch.equal(side.rows()[dst[:4]], original[src[:4]]) and not side.rows()[dst[4:]].any()
    # Nothing to load: the answer is where the caller started, and the lease is gone anyway.
    assert e.lookup(keys, lease=Lease(5)) == 2 * CHUNK
    assert e.retrieve(keys, dst, skip_blocks=4, lease=Lease(5)) == 4 * B
    assert side.pins_become((0, 0)) == (0, 0)


def test_async_and_layered_loads_answer_as_a_plain_load(side: Side) -> None:
    e = side.engine
    keys = e.chunk_keys(prompt(5, 2))
    e.store(keys, [0, 1, 2, 3]).wait()
    caps = e.capabilities
    assert isinstance(caps, Capabilities) and not caps.layered_loads  # a CPU pool: never by layer
    pending = e.retrieve_async(keys, [8, 9, 10, 11], by_layer=True)
    assert pending.result() == 2 * CHUNK and pending.done() and pending.layered is None
    end, layered = e.retrieve_by_layer(keys, [12, 13, 14, 15])
    assert (end, layered) == (2 * CHUNK, None)
    rows = side.rows()
    assert torch.equal(rows[[8, 9, 10, 11]], rows[[0, 1, 2, 3]]) and torch.equal(rows[[12, 13, 14, 15]], rows[[0, 1, 2, 3]])
    assert side.pins_become((0, 0)) == (0, 0)


def test_what_each_engine_declares(side: Side) -> None:
    e = side.engine
    assert e.ready and e.layout.chunk_size == CHUNK and e.layout.tokens_per_block == B
    tokens = prompt(6, 3)
    assert e.chunk_keys(tokens) == e.hasher.chunk_keys(tokens) and len(e.chunk_keys(tokens + [1] * 5)) == 3
    # Only the server's engine answers a load before it is enqueued.
    assert e.capabilities.async_loads == isinstance(e, RemoteEngine)


# ---- the protocol itself --------------------------------------------------------------------------


def _members(cls: type) -> dict[str, inspect.Signature | None]:
    """Public members of a class: methods with their signatures (self dropped), others as None."""
    out: dict[str, inspect.Signature | None] = {}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(value):
            sig = inspect.signature(value)
            out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
        else:
            out[name] = None
    return out


def test_each_engine_offers_every_member_of_the_protocol_with_its_parameters(side: Side) -> None:
    """Structural conformance, checked at run time (no type checker runs in CI): every method of
    ``Engine`` with the same parameters (names, kinds, defaults), every property and attribute."""
    engine = side.engine
    wanted = {**_members(Engine), **dict.fromkeys(Engine.__annotations__)}  # ``config``: an attribute
    assert wanted.keys() >= {"probe", "lookup", "release", "store", "retrieve", "retrieve_by_layer",
                             "retrieve_async", "promotion_done", "capabilities", "layout", "hasher", "ready", "config"}
    for name, sig in wanted.items():
        assert name in dir(engine), f"{type(engine).__name__} lacks {name}"
        if sig is None:
            continue
        have = inspect.signature(getattr(type(engine), name))
        have_params = [(p.name, p.kind, p.default) for p in list(have.parameters.values())[1:]]
        want_params = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
        assert have_params == want_params, f"{type(engine).__name__}.{name}{have} differs from Engine.{name}{sig}"
