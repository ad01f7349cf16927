"""/metrics: every declared series is served, the Grafana dashboard names only those, the listen
address is configurable, and a port that cannot be bound is named in the error."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from client_proc import BLOCKS, prompt
from mp_helpers import CHUNK, DTYPE, POOL_SHAPE, fill

from kvdepot.config import load_config
from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server.client import DepotClient
from kvdepot.server.metrics import exported_series, start_metrics
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvdepot.json"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape(host: str, port: int) -> str:
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()


def sampled(body: str) -> set[str]:
    """Names of the series that carry at least one sample in a Prometheus text exposition."""
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ", body, re.M)}


def dashboard_series() -> set[str]:
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"\bkvdepot_[a-z_]+", e)}
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    names |= {n for v in templating for n in re.findall(r"\bkvdepot_[a-z_]+", str(v.get("query", "")))}
    return names


def test_every_exported_series_is_served_with_a_disk_tier(tmp_path: Path) -> None:
    short = Path("/tmp") / f"kvd-m-{tmp_path.name[-8:]}"
    short.mkdir()
    port = free_port()
    config = load_config(chunk_size=CHUNK, host_capacity_gb=0.01, disk_path=str(tmp_path / "disk"), disk_capacity_gb=0.01)
    try:
        with DepotServer(f"ipc://{short}/m.sock", config, metrics_port=port) as server:
            c = DepotClient(server.url, timeout_s=5.0)
            try:
                engine = RemoteEngine(c, fill(torch.zeros(POOL_SHAPE, dtype=DTYPE), 0), 8, model_id="metrics", mode="bytes")
                keys = engine.chunk_keys(prompt(6))
                engine.store(keys, list(range(BLOCKS))).wait()
                engine.lookup(keys, lease=1)
                c.call(p.Ping())
                body = scrape("127.0.0.1", port)
            finally:
                c.close()
    finally:
        for f in short.iterdir():
            f.unlink()
        short.rmdir()
    missing = exported_series() - sampled(body)
    assert not missing, f"declared but not served: {sorted(missing)}"
    assert 'kvdepot_tier_capacity_bytes{model="metrics",rank="0",tier="disk"} 1e+07' in body


def test_dashboard_names_only_exported_series() -> None:
    names = dashboard_series()
    assert len(names) >= 15  # the dashboard covers the shard, tier and server series
    unknown = names - exported_series()
    assert not unknown, f"docs/grafana/kvdepot.json queries series kvdepot does not export: {sorted(unknown)}"


def test_metrics_host_is_the_listen_address() -> None:
    port = free_port("127.0.0.2")
    stop = start_metrics(lambda: p.StatsReply(1, 1, "ipc:///x", 0.0, 0, 0, 0, []), port, "127.0.0.2")
    try:
        assert "kvdepot_clients 0.0" in scrape("127.0.0.2", port)
        with pytest.raises(urllib.error.URLError):
            scrape("127.0.0.1", port)  # not every interface: only the one asked for
    finally:
        stop()
    assert load_config().metrics_host == "127.0.0.1"  # the default stays loopback


def test_a_taken_port_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KVDepotError, match=f"127.0.0.1:{port}"):
            start_metrics(lambda: p.StatsReply(1, 1, "ipc:///x", 0.0, 0, 0, 0, []), port)


def test_a_taken_metrics_port_refuses_the_server_start_and_leaves_no_socket() -> None:
    from mp_helpers import short_dir

    work = short_dir()
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            server = DepotServer(f"ipc://{work}/s.sock", load_config(host_capacity_gb=0.01), metrics_port=port)
            with pytest.raises(KVDepotError, match=f"127.0.0.1:{port}"):
                server.start()
        assert not (work / "s.sock").exists()
        server.stop()
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
