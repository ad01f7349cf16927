"""How the TensorRT-LLM connector picks its mode: by configuration for ``KvDepotScheduler`` /
``KvDepotWorker``, pinned for the ``adapter`` and ``mp_adapter`` names configurations use."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from kvdepot.config import load_config
from kvdepot.integrations.tensorrt_llm import (
    KvDepotScheduler,
    KvDepotWorker,
    SchedulerOutput,
    adapter,
    mp_adapter,
)
from kvdepot.integrations.tensorrt_llm.providers import (
    InProcess,
    ViaServer,
    current_engine,
    current_remote,
)
from kvdepot.integrations.tensorrt_llm.setup import Setup
from kvdepot.runtime.llm_args import KvCacheConfig, TorchLlmArgs
from kvdepot.server.paths import default_url
from kvdepot.server.server import DepotServer

URL = "ipc:///tmp/kvdepot-test-unused.sock"


def args() -> TorchLlmArgs:
    return TorchLlmArgs(model="tiny", kv_cache_config=KvCacheConfig(tokens_per_block=8))


def test_no_server_url_is_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDEPOT_SERVER_URL", raising=False)
    setup = Setup.from_llm_args(args())
    assert setup.server_url is None and isinstance(setup.provider(), InProcess)
    assert setup.tokens_per_block == 8 and (setup.tp_rank, setup.tp_size) == (0, 1)


def test_a_configured_server_url_is_server_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_SERVER_URL", URL)
    setup = Setup.from_llm_args(args())
    assert setup.server_url == URL and isinstance(setup.provider(), ViaServer)


def test_pinned_modes_win_over_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDEPOT_SERVER_URL", raising=False)
    assert Setup.from_llm_args(args(), server=True).server_url == default_url()  # mp_adapter's default socket
    monkeypatch.setenv("KVDEPOT_SERVER_URL", URL)
    assert Setup.from_llm_args(args(), server=False).server_url is None


def test_the_configured_names_are_the_one_connector_pinned() -> None:
    assert (KvDepotScheduler.server, KvDepotWorker.server) == (None, None)
    assert issubclass(adapter.KvDepotConnectorScheduler, KvDepotScheduler)
    assert issubclass(adapter.KvDepotConnectorWorker, KvDepotWorker)
    assert (adapter.KvDepotConnectorScheduler.server, adapter.KvDepotConnectorWorker.server) == (False, False)
    assert issubclass(mp_adapter.KvDepotMPConnectorScheduler, KvDepotScheduler)
    assert issubclass(mp_adapter.KvDepotMPConnectorWorker, KvDepotWorker)
    assert (mp_adapter.KvDepotMPConnectorScheduler.server, mp_adapter.KvDepotMPConnectorWorker.server) == (True, True)
    for cls in (adapter.KvDepotConnectorScheduler, adapter.KvDepotConnectorWorker,
                mp_adapter.KvDepotMPConnectorScheduler, mp_adapter.KvDepotMPConnectorWorker):
        assert not [name for name, value in vars(cls).items() if callable(value)], cls  # thin: nothing overridden


@pytest.fixture
def server():
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # an ipc:// path must be short
    srv = DepotServer(f"ipc://{path}/s.sock", load_config(chunk_size=16, host_capacity_gb=0.01)).start()
    yield srv
    srv.stop()
    shutil.rmtree(path, ignore_errors=True)


def test_the_same_classes_register_with_the_server_when_a_url_is_configured(server, monkeypatch) -> None:
    """One worker class: KVDEPOT_SERVER_URL alone moves it from in-process to the server."""
    pool = torch.zeros(8, 2, 2, 4 * 8 * 4)
    monkeypatch.delenv("KVDEPOT_SERVER_URL", raising=False)
    KvDepotWorker(args()).register_kv_caches(pool)
    assert current_engine() is not None and current_remote() is None
    monkeypatch.setenv("KVDEPOT_SERVER_URL", server.url)
    monkeypatch.setenv("KVDEPOT_SERVER_TIMEOUT_S", "1")
    scheduler, worker = KvDepotScheduler(args()), KvDepotWorker(args())
    worker.register_kv_caches(pool)
    remote = current_remote()
    assert remote is not None and current_engine() is None  # the in-process engine was closed and replaced
    assert remote.client.url == server.url
    assert len(remote.chunk_keys(list(range(32)))) == 2  # registered: the server's chunk size
    meta = scheduler.build_connector_meta(SchedulerOutput())
    assert meta.lease_session == remote.client.session_id > 0  # the scheduler looks up in the server
