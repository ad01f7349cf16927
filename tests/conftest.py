"""Suite-wide pytest hooks and fixtures.

Items marked ``gpu`` need a CUDA device: without one they are skipped at collection, with the
reason in the report, so the CPU-only CI run stays green and the same files run on a GPU host.

``redis_server`` / ``redis_factory``: a real ``redis-server`` on a free loopback port, persistence
off (``--save "" --appendonly no``), in the test's tmp dir, killed at teardown. Tests skip only
when the binary is absent (Debian package ``redis-server``; CI installs it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from redis_server import REDIS_SERVER, RedisServer  # tests/ is on sys.path (pytest's prepend mode)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kvdepot_env_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDEPOT_* configuration leaks in from the environment running the tests."""
    for key in ("KVDEPOT_CONFIG_FILE", "KVDEPOT_CHUNK_SIZE", "KVDEPOT_HOST_CAPACITY_GB", "KVDEPOT_SAVE_DECODE_CACHE"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start redis-servers (extra command-line arguments allowed); all are killed at teardown."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found: apt-get install redis-server")
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        workdir = tmp_path / f"redis{len(started)}"
        workdir.mkdir()
        server = RedisServer(workdir, *extra)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_factory()
