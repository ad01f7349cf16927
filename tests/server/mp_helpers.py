"""Shared by the server tests: short socket paths, server subprocesses, deterministic pools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import shared_cpu_pool

# Small geometry: 8 tokens per block, 2 layers, K and V, 4 heads x 8 tokens x 4 dims of bf16.
TOKENS_PER_BLOCK = 8
CHUNK = 16
POOL_SHAPE = (32, 2, 2, 4 * TOKENS_PER_BLOCK * 4)
DTYPE = torch.bfloat16
SERVER_ARGS = ("--chunk-size", str(CHUNK), "--host-capacity-gb", "0.01", "--log-level", "WARNING")


def short_dir() -> Path:
    """A fresh directory short enough for an ipc:// socket path (108 bytes at most)."""
    return Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))


def fill(pool: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool.copy_(torch.randn(pool.shape, generator=gen).to(pool.dtype))
    return pool


def make_pool(mode: str, directory: Path, seed: int = 0, name: str = "pool") -> torch.Tensor:
    """A filled CPU pool: in a shared file for "shm" (mappable by the server), plain otherwise."""
    if mode == "shm":
        pool = shared_cpu_pool(str(directory / name), POOL_SHAPE, DTYPE)
    else:
        pool = torch.zeros(POOL_SHAPE, dtype=DTYPE)
    return fill(pool, seed)


def start_server(url: str, *extra: str, log: Path | None = None, timeout: float = 30.0,
                 script: Path | None = None) -> subprocess.Popen:
    """``python -m kvdepot.server`` (or a test's ``script`` wrapping it) in a subprocess; returns
    once it listens (log next to the socket)."""
    log = log or Path(url.removeprefix("ipc://") + ".log")
    entry = [str(script)] if script is not None else ["-m", "kvdepot.server"]
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, *entry, "--url", url, *SERVER_ARGS, *extra],
            stdout=sink, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "listening on" in log.read_text():
            proc.log = log  # type: ignore[attr-defined]
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout} s: {log.read_text()}")


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def stats(client: DepotClient):  # type: ignore[no-untyped-def]
    from kvdepot.server.protocol import GetStats

    reply, _ = client.call(GetStats())
    return reply


def totals(reply) -> dict[str, float]:  # type: ignore[no-untyped-def]
    out: dict[str, float] = {}
    for shard in reply.shards:
        for key, value in shard.figures.items():
            out[key] = out.get(key, 0.0) + value
    return out


def run_client(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("client_proc.py")
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)


def spawn_client(*args: str) -> subprocess.Popen:
    script = Path(__file__).with_name("client_proc.py")
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True)


def env_without_cuda() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
