"""A real ``redis-server`` for tests: free loopback port, persistence off, stop/pause/restart."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process that a test can stop, pause and restart on the same port."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.workdir, self.extra = workdir, extra
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--logfile", "redis.log", *self.extra,
        ]
        self.proc = subprocess.Popen(args, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        log = (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {log[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)  # a paused server must be able to die
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        password = None
        if "--requirepass" in self.extra:
            password = self.extra[self.extra.index("--requirepass") + 1]
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, password=password)
