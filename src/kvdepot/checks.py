"""``kvdepot config --check``: probe what the effective config points at, before an engine does.

    run_checks(out) -> int       one line per check ("ok", "FAIL" or "skip"); 1 if any failed

Each probe does what kvdepot itself will do, once and quickly: write and remove a file in
``disk_path``, PING ``remote_url``, say HELLO to the server (or show that its socket directory
is usable), and open or bind the metrics port. A failure names the key, the value and the
reason, so one look at the output says what to fix. A bad config itself is reported by the
caller (one line, status 2) before any check runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvdepot.config import DepotConfig, load_config
from kvdepot.errors import KVDepotError


@dataclass(frozen=True)
class Check:
    status: str  # ok / FAIL / skip
    key: str
    text: str


def check_disk(config: DepotConfig) -> Check:
    path = config.disk_path
    if not path:
        return Check("skip", "disk_path", "unset: no disk tier")
    target = Path(path)
    probe_dir = target if target.exists() else next((p for p in target.parents if p.exists()), Path("/"))
    if target.exists() and not target.is_dir():
        return Check("FAIL", "disk_path", f"{path}: exists and is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".kvdepot-check-", dir=probe_dir)
        try:
            os.write(fd, b"kvdepot")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return Check("FAIL", "disk_path", f"{path}: cannot write a file in {probe_dir} ({exc.strerror or exc})")
    free = shutil.disk_usage(probe_dir).free / 1e9
    state = "writable" if target.exists() else f"will be created (in {probe_dir}, writable)"
    status = "ok" if free >= config.disk_capacity_gb else "FAIL"
    note = "" if status == "ok" else "; less free space than disk_capacity_gb: lower it or free space"
    return Check(status, "disk_path", f"{path}: {state}, {free:.1f} GB free for disk_capacity_gb "
                 f"{config.disk_capacity_gb:g}{note}")


def check_remote(config: DepotConfig) -> Check:
    url = config.remote_url
    if not url:
        return Check("skip", "remote_url", "unset: no Redis tier")
    shown = _redact(url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return Check("FAIL", "remote_url", f"{shown}: expected a redis://, rediss:// or unix:// URL")
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=config.remote_timeout_s,
                                      socket_connect_timeout=config.remote_timeout_s)
    except ValueError as exc:
        return Check("FAIL", "remote_url", f"{shown}: malformed ({exc})")
    try:
        started = time.perf_counter()
        client.ping()
        rtt = (time.perf_counter() - started) * 1e3
        info = client.info("server")
        return Check("ok", "remote_url", f"{shown}: PING answered in {rtt:.1f} ms "
                     f"({info.get('redis_version', '?')}, maxmemory-policy "
                     f"{client.config_get('maxmemory-policy').get('maxmemory-policy', '?')})")
    except redis.ResponseError:  # CONFIG may be disabled on a managed server: the PING answered
        return Check("ok", "remote_url", f"{shown}: PING answered")
    except (redis.RedisError, OSError) as exc:
        return Check("FAIL", "remote_url", f"{shown}: {type(exc).__name__}: {exc}")
    finally:
        client.close()


def check_server(config: DepotConfig) -> Check:
    from kvdepot.server.client import DepotClient
    from kvdepot.server.paths import check_url, default_url, ipc_path

    try:
        url = check_url(config.server_url or default_url())
    except KVDepotError as exc:
        return Check("FAIL", "server_url", str(exc))
    client = DepotClient(url, timeout_s=min(2.0, config.server_timeout_s), heartbeat_s=3600.0,
                         name="kvdepot-check", connect=False, log_outages=False)
    try:
        if client.connect():
            from kvdepot.server import protocol as p

            stats, _ = client.call(p.GetStats())
            return Check("ok", "server_url", f"{url}: a kvdepot server answers (pid {stats.pid}, "
                         f"{stats.sessions} clients)")
    except KVDepotError as exc:
        return Check("FAIL", "server_url", f"{url}: {exc}")
    finally:
        client.close()
    path = ipc_path(url)
    if path is None:
        return Check("ok", "server_url", f"{url}: no server answers (start one: kvdepot server --url {url})")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return Check("FAIL", "server_url", f"{url}: no server answers and {path.parent} is not writable: "
                     "a server could not create its socket there")
    return Check("ok", "server_url", f"{url}: no server answers; {path.parent} is usable for its socket "
                 "(multi-process mode only: in-process engines need no server)")


def check_metrics(config: DepotConfig) -> Check:
    port, host = config.metrics_port, config.metrics_host
    if not port:
        return Check("skip", "metrics_port", "0: the server serves no metrics")
    url = f"http://{host if host != '0.0.0.0' else '127.0.0.1'}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            body = reply.read(1 << 20).decode(errors="replace")
        if "kvdepot_" in body:
            return Check("ok", "metrics_port", f"{host}:{port}: a kvdepot server's metrics answer")
        return Check("FAIL", "metrics_port", f"{host}:{port}: taken by something that is not kvdepot ({url})")
    except (urllib.error.URLError, OSError):
        pass
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, port))
    except OSError as exc:
        return Check("FAIL", "metrics_port", f"{host}:{port}: cannot listen ({exc.strerror or exc})")
    return Check("ok", "metrics_port", f"{host}:{port}: free for the server's /metrics")


CHECKS: tuple[Callable[[DepotConfig], Check], ...] = (check_disk, check_remote, check_server, check_metrics)


def run_checks(out: TextIO, config: DepotConfig | None = None) -> int:
    config = config or load_config()
    failed = False
    for probe in CHECKS:
        result = probe(config)
        failed |= result.status == "FAIL"
        print(f"{result.status:<4}  {result.key:<12}  {result.text}", file=out, flush=True)
    return 1 if failed else 0


def _redact(url: str) -> str:
    """A URL without its password, fit to print."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}" if ":" in creds else url
