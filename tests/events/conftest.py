"""Fixtures of the KV-event tests: short ipc addresses, a ZMQ context, CPU engines with events on."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq
from event_helpers import BPC, CHUNK, TPB

from kvdepot.config import DepotConfig
from kvdepot.engine import CacheEngine


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short directory for ipc:// sockets (their paths are limited to ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvev", dir="/tmp") as path:
        yield path


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def make_engine(ipc_dir: str) -> Iterator[Callable[..., CacheEngine]]:
    """CPU engines with events on (own publisher, replay on loopback); closed at teardown."""
    made: list[CacheEngine] = []

    def make(capacity_chunks: int = 8, num_blocks: int = 32, name: str = "e", **config: object) -> CacheEngine:
        pool = torch.randint(0, 256, (num_blocks, 2, 2, TPB * 2), dtype=torch.uint8).view(torch.float16)
        chunk_bytes = BPC * pool[0].numel() * pool.element_size()
        settings = dict(
            chunk_size=CHUNK, host_capacity_gb=(capacity_chunks * chunk_bytes + 0.5) / 1e9, model_id="m",
            kv_events_endpoint=f"ipc://{ipc_dir}/{name}{len(made)}", kv_events_replay_endpoint="tcp://127.0.0.1:0",
        )
        settings.update(config)
        engine = CacheEngine.for_pool(pool, TPB, config=DepotConfig(**settings))  # type: ignore[arg-type]
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvdepot-kv-events")]
    assert not left, f"publisher threads left running: {left}"


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvdepot-kv-events")]
    assert not left, f"threads left running: {left}"


