"""The progress page across real processes: the file leaves /dev/shm once REGISTER is answered,
the server maps it for the session's life and unmaps it when the session (or the registration)
ends, the client's mapping goes with its engine; ``layer_progress: rpc`` sends none. And a load
followed through the page of a server killed mid-load ends in ``TransferFailed`` from the first
layer not yet recorded. The GPU half (bit-exact layered loads through the page) is
tests/server/test_gpu_ipc.py."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mp_helpers import SERVER_ARGS, TOKENS_PER_BLOCK, stop_server, wait_for

from kvdepot.config import load_config
from kvdepot.server import protocol as p
from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import ExportedPool
from kvdepot.server.layer_follow import FencedFailure, RemoteProgress, Watch
from kvdepot.server.progress_page import PAGE_SUPPORTED, ProgressPage
from kvdepot.server.remote import RemoteEngine
from kvdepot.transfer.layered import TransferFailed

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not PAGE_SUPPORTED or not os.path.isdir("/proc/self"), reason="x86-64 Linux")]

LAYERS = 4
SHAPE = (16, LAYERS, 2, 64)


def _mapped(path: str, pid: int | str = "self") -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any(path in line for line in maps)


def _spawn(argv: list[str], log: Path, ready: str, timeout: float = 60.0) -> subprocess.Popen:
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, *argv], stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"process did not start: {log.read_text()}")
        time.sleep(0.05)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _as_cuda(engine: RemoteEngine) -> None:
    """Make the engine believe its pool is a CUDA pool with layer events, then register again."""
    desc = p.CudaIpcPool(b"\0" * 64, 0, engine.pool.nbytes, "stand-in", layer_events=(b"",) * LAYERS)  # type: ignore[union-attr]
    engine.exported = ExportedPool(engine.pool, desc, None, [object()] * LAYERS)  # type: ignore[arg-type]
    engine._register()


def test_the_page_lives_as_long_as_the_registration_and_leaves_no_file(workdir):
    url = f"ipc://{workdir}/p.sock"
    script = str(Path(__file__).with_name("fake_cuda_server.py"))
    server = _spawn([script, "--url", url, *SERVER_ARGS, "--log-level", "INFO"], workdir / "server.log", "listening on")
    client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.2, name="paged")
    try:
        engine = RemoteEngine(client, torch.zeros(SHAPE, dtype=torch.bfloat16), TOKENS_PER_BLOCK, model_id="page", mode="bytes")
        assert engine._page is None  # a bytes pool: no loads by layer, no page
        _as_cuda(engine)
        first = engine._page
        assert first is not None and engine.granted.progress_page  # type: ignore[union-attr]
        assert not os.path.exists(first.path)  # unlinked once answered: nothing stays in /dev/shm
        assert _mapped(first.path) and _mapped(first.path, server.pid)

        _as_cuda(engine)  # the worker registers again: a fresh page; the old one goes on both sides
        second, old = engine._page, first.path
        assert second is not None and second.path != old and _mapped(second.path, server.pid)
        assert wait_for(lambda: not _mapped(old, server.pid))
        del first  # no load follows it any more: its mapping goes with the last reference
        gc.collect()
        assert not _mapped(old)

        engine.close()
        gc.collect()
        assert not _mapped(second.path)
        client.close()  # END_SESSION: the server unmaps the session's page
        assert wait_for(lambda: not _mapped(second.path, server.pid))
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvdepot-progress-{os.getpid()}-")]
    finally:
        client.close()
        assert stop_server(server) == 0, server.log.read_text()  # type: ignore[attr-defined]


def test_layer_progress_rpc_sends_no_page(workdir):
    url = f"ipc://{workdir}/r.sock"
    script = str(Path(__file__).with_name("fake_cuda_server.py"))
    server = _spawn([script, "--url", url, *SERVER_ARGS], workdir / "server.log", "listening on")
    client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.2, name="rpc")
    try:
        engine = RemoteEngine(client, torch.zeros(SHAPE, dtype=torch.bfloat16), TOKENS_PER_BLOCK, model_id="rpc",
                              mode="bytes", config=load_config(layer_progress="rpc"))
        _as_cuda(engine)
        assert engine._page is None and not engine.granted.progress_page  # type: ignore[union-attr]
        engine.close()
    finally:
        client.close()
        stop_server(server)


@pytest.mark.parametrize("read_first", [True, False], ids=["after-layer-1", "before-layer-0"])
def test_a_server_killed_mid_load_fails_the_next_layer_not_recorded(workdir, read_first):
    """The bench's simulated server (the real loop, LAYERS and page; 0.2 s per layer's "copies",
    5 s where it must not record layer 0 before the kill). ``before-layer-0``: killed right after
    its reply, which (with a page) comes before any layer is enqueued: the client's first wait
    fails, as any later one does."""
    url, stamps = f"ipc://{workdir}/k.sock", workdir / "stamps"
    np.memmap(stamps, dtype=np.int64, mode="w+", shape=(LAYERS,)).flush()
    issue_us = 200_000 if read_first else 5_000_000  # before-layer-0: no skew of a busy box lets it record layer 0
    server = _spawn(["-m", "kvdepot.bench.hooks_server", url, str(LAYERS), str(issue_us), "100", str(stamps)],
                    workdir / "server.log", "")
    client = DepotClient(url, timeout_s=0.5, heartbeat_s=0.1, name="killed", connect=False)
    page = ProgressPage.create()
    try:
        assert wait_for(client.connect, timeout=30)
        desc = p.CudaIpcPool(b"\0" * 64, 0, 1, "sim", layer_events=(b"",) * LAYERS, progress_page=page.path)
        reply, _ = client.call(p.Register("k", 0, 1, 32, 1, LAYERS, 2, 1, "bfloat16", 4 * LAYERS, desc), handshake=True)
        page.unlink()
        assert reply.progress_page  # type: ignore[attr-defined]
        deadline = time.monotonic_ns() + 10_000_000_000
        load, _ = client.call(p.Retrieve(b"", [0], deadline_ns=deadline, by_layer=True, early=True))
        load_id = load.load_id  # type: ignore[attr-defined]
        follow = RemoteProgress(lambda through: client.submit(p.Layers(load_id, through)), load.layers_ready,  # type: ignore[attr-defined]
                                LAYERS, client.timeout_s, Watch(page, load_id, deadline, lambda: client.ready))
        if read_first:
            follow.through(1)  # read from the page (the server records one layer per 0.2 s)
            assert follow.stats.asks == 0
        else:
            assert load.layers_ready == 0  # type: ignore[attr-defined]  # the reply came before layer 0
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        started = time.monotonic()
        with pytest.raises(TransferFailed) as raised:
            follow.through(LAYERS - 1 if read_first else 0)
        assert not isinstance(raised.value, FencedFailure)  # nothing the client could wait on
        assert time.monotonic() - started < 5.0
        assert follow.ready < LAYERS  # never reported past what the server recorded
    finally:
        page.close()
        client.close()
        if server.poll() is None:
            server.kill()
            server.wait()
