"""The shared tier of ``kvdepot bench cluster``: a real Redis Cluster of three masters.

    cluster = RedisCluster(workdir, host="127.0.0.1"); cluster.start()
    cluster.url        the seed node (config ``remote_url`` with ``remote_cluster: true``)
    cluster.flush()    empty every master (between two configurations of the bench)
    cluster.stop()

Masters only (no replicas), persistence off: the bench measures hits, not durability. ``host``
is the address the masters bind and announce (loopback, or the host side of the bench's
network namespaces).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvdepot.errors import KVDepotError


def free_cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind((host, port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    def __init__(self, workdir: Path, masters: int = 3, host: str = "127.0.0.1") -> None:
        self.workdir, self.host = workdir, host
        self.ports = [free_cluster_port(host) for _ in range(masters)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.ports[0]}/0"

    def start(self) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise KVDepotError("bench cluster needs redis-server and redis-cli on PATH (apt-get install redis-server)")
        for i, port in enumerate(self.ports):
            node_dir = self.workdir / f"redis{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.procs.append(subprocess.Popen(
                [server, "--port", str(port), "--bind", self.host, "--cluster-announce-ip", self.host,
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                 "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--logfile", "redis.log",
                 # off the loopback (--netns: a bridge only this machine's namespaces reach) Redis
                 # would refuse every client of a password-less server
                 "--protected-mode", "yes" if self.host.startswith("127.") else "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port, proc in zip(self.ports, self.procs, strict=True):
            self._wait_port(port, proc)
        made = subprocess.run([cli, "--cluster", "create", *(f"{self.host}:{p}" for p in self.ports),
                               "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            raise KVDepotError(f"redis-cli --cluster create failed: {(made.stdout + made.stderr)[-1000:]}")
        self._wait_ok()

    def flush(self) -> None:
        for client in self._clients():
            client.flushall()
            client.close()

    def keys(self) -> int:
        """Keys held by all masters together."""
        total = 0
        for client in self._clients():
            total += int(client.dbsize())
            client.close()
        return total

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()

    def _clients(self) -> list:
        import redis

        return [redis.Redis(host=self.host, port=p, socket_timeout=5) for p in self.ports]

    def _wait_port(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, port), timeout=0.2):
                    return
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.02)
        raise KVDepotError(f"redis-server did not start on {self.host}:{port} (see {self.workdir}/redis*/redis.log)")

    def _wait_ok(self, timeout_s: float = 20) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                clients = self._clients()
                states = [b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients]
                for c in clients:
                    c.close()
                if all(states):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise KVDepotError("the bench's Redis Cluster did not reach cluster_state:ok")
