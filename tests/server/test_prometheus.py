"""A real Prometheus server scrapes a running ``kvdepot server`` and answers queries for kvdepot's
series over its HTTP API — what an operator's monitoring does, end to end.

Debian's ``prometheus`` package (``.ci/run`` installs it); the test starts it on loopback with a
generated config (1 s scrape interval, a private TSDB directory) and stops it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import torch
from client_proc import BLOCKS, prompt
from mp_helpers import DTYPE, POOL_SHAPE, SERVER_ARGS, fill, short_dir, stop_server

from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get install prometheus)"),
              pytest.mark.timeout(120), pytest.mark.slow]  # ~5 s idle, 15 s on a loaded 2-core VM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(fn, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        reply = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return []
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_prometheus_scrapes_a_running_server() -> None:
    work = short_dir()
    metrics, web = free_port(), free_port()
    url = f"ipc://{work}/s.sock"
    log = work / "server.log"
    with open(log, "w") as sink:  # the `kvdepot server` command itself
        server = subprocess.Popen([sys.executable, "-m", "kvdepot.cli", "server", "--url", url, *SERVER_ARGS,
                                   "--metrics-port", str(metrics)], stdout=sink, stderr=subprocess.STDOUT)
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: kvdepot\n    static_configs:\n      - targets: ['127.0.0.1:{metrics}']\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "w"))  # noqa: SIM115
    client = None
    try:
        wait_until(lambda: "listening on" in log.read_text() or server.poll() is not None, 30, "the kvdepot server")
        assert server.poll() is None, log.read_text()
        client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.5, name="prom-test")
        engine = RemoteEngine(client, fill(torch.zeros(POOL_SHAPE, dtype=DTYPE), 0), 8, model_id="prom", mode="bytes")
        keys = engine.chunk_keys(prompt(6))
        engine.store(keys, list(range(BLOCKS))).wait()
        assert engine.lookup(keys, lease=1) > 0
        # Prometheus's view, through its HTTP API: the target is up and kvdepot's figures arrived.
        up = wait_until(lambda: [r for r in query(web, 'up{job="kvdepot"}') if r["value"][1] == "1"], 60,
                        "Prometheus to scrape the kvdepot server")
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{metrics}"
        hits = wait_until(lambda: [r for r in query(web, 'kvdepot_hits_total{model="prom"}') if float(r["value"][1]) > 0],
                          30, "kvdepot_hits_total in Prometheus")
        assert hits[0]["metric"]["rank"] == "0" and float(hits[0]["value"][1]) == len(keys)
        stored = query(web, 'kvdepot_bytes_stored_total{model="prom"}')
        assert float(stored[0]["value"][1]) > 0
        assert float(query(web, "kvdepot_clients")[0]["value"][1]) >= 1
        ratio = query(web, 'sum(kvdepot_hits_total) / (sum(kvdepot_hits_total) + sum(kvdepot_misses_total))')
        assert 0 < float(ratio[0]["value"][1]) <= 1  # a dashboard's expression evaluates
    finally:
        if client is not None:
            client.close()
        prom.terminate()
        try:
            prom.wait(15)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        stop_server(server)
        shutil.rmtree(work, ignore_errors=True)
    assert prom.returncode is not None and server.returncode is not None
