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
from redis.crc import key_slot

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


REDIS_CLI = shutil.which("redis-cli")


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a port and free too."""
    while True:
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisClusterServers:
    """Three masters of a real Redis Cluster on loopback (no replicas), each a ``RedisServer``
    whose node a test can kill and restart: its slots (``cluster-config-file``) and data
    (append-only file, fsynced per write) come back with it on the same port."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        self._owners: list[tuple[int, int, RedisServer]] = []
        for i in range(masters):
            node_dir = workdir / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(RedisServer(
                node_dir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                "--appendonly", "yes", "--appendfsync", "always",
            ))
            self.nodes[-1].port = _free_cluster_port()

    @property
    def url(self) -> str:
        """The seed node's URL (what ``remote_url`` names with ``remote_cluster``)."""
        return self.nodes[0].url

    def start(self) -> None:
        assert REDIS_CLI is not None
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        made = subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                              capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout[-2000:]} {made.stderr[-2000:]}")
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 15) -> None:
        """Until every running node reports cluster_state:ok and knows every slot's master.
        cluster_state:ok alone is not that: with require-full-coverage off a node reports it while
        gossip has yet to tell it another master's slots (a CI run read CLUSTER SLOTS then, and
        found 2 masters of 3)."""
        want = (b"cluster_state:ok", b"cluster_slots_assigned:16384", f"cluster_size:{len(self.nodes)}\r".encode(),
                f"cluster_known_nodes:{len(self.nodes)}\r".encode())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(all(w in node.client().execute_command("CLUSTER", "INFO") for w in want)
                       for node in self.nodes if node.proc is not None):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the test cluster did not reach cluster_state:ok")

    def node_of(self, name: bytes) -> RedisServer:
        """The node serving the slot of key ``name`` (slots never move in these tests: the map
        is read once)."""
        if not self._owners:
            for first, last, master, *_ in self.nodes[0].client().execute_command("CLUSTER", "SLOTS"):
                port = int(master[1])
                self._owners.append((first, last, next(n for n in self.nodes if n.port == port)))
        slot = key_slot(name)
        return next(node for first, last, node in self._owners if first <= slot <= last)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
