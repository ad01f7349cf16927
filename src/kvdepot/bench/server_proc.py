"""A ``kvdepot server`` subprocess for benchmarks: started on a private ipc:// socket, stopped cleanly.

    with running_server("--chunk-size", "256", "--host-capacity-gb", "8") as url:
        ...   # KVDEPOT_SERVER_URL=url clients share it
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvdepot.bench.subprocs import terminate
from kvdepot.server.client import DepotClient


@contextlib.contextmanager
def running_server(*args: str, timeout_s: float = 120.0) -> Iterator[str]:
    """Yield the URL of a fresh server (``args`` are its flags) once it answers HELLO."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp"))  # short: socket paths are limited
    url = f"ipc://{workdir}/server.sock"
    # KVD_BENCH_SERVER_LOG: a file for the server's warnings (default: dropped; not a KVDEPOT_ name,
    # which the config would refuse as an unknown key)
    log_path = os.environ.get("KVD_BENCH_SERVER_LOG")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.server", "--url", url, "--log-level", "WARNING", *args],
                            stdout=subprocess.DEVNULL, stderr=log)
    probe = DepotClient(url, timeout_s=5.0, heartbeat_s=3600.0, name="bench-probe", connect=False, log_outages=False)
    try:
        deadline = time.monotonic() + timeout_s
        while not probe.connect():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the kvdepot server did not start (exit code {proc.poll()})")
            time.sleep(0.2)
        probe.close()
        yield url
    finally:
        probe.close()
        terminate(proc, 30)
        if log is not subprocess.DEVNULL:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def arena_allocated(stats) -> bool:
    """Whether every shard of a server's ``stats()`` has its host arena pinned: stores that arrive
    before are refused, and on CUDA hosts pinning a few GB takes seconds."""
    figures = [shard.figures for shard in stats.shards] if stats is not None else []
    return bool(figures) and all(f.get("host_pending_chunks", 1) == 0 for f in figures)
