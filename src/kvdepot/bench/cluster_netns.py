"""``kvdepot bench cluster --netns``: every node in its own network namespace.

    with Namespaces(nodes) as net:
        net.redis_host     the bridge's address, where the Redis Cluster binds and announces
        net.prefix(i)      ("ip", "netns", "exec", NAME): run node i inside its namespace

One Linux bridge in the bench's namespace with 10.213.S.1/24 and, per node, a namespace whose
end of a veth pair holds 10.213.S.(10+i): each node reaches Redis through its own interface,
as separate hosts would, instead of sharing the loopback device. ``S`` comes from the bench's
pid, so two runs do not collide. Everything is removed on exit (deleting a namespace deletes its
veth pair). Needs root and iproute2; KV events still travel over ``ipc://`` paths in /tmp, which
every namespace sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from types import TracebackType

from kvdepot.errors import KVDepotError


class Namespaces:
    def __init__(self, nodes: int) -> None:
        if shutil.which("ip") is None or os.geteuid() != 0:
            raise KVDepotError("--netns needs root and iproute2's ip (ip netns); run without --netns for loopback")
        pid = os.getpid()
        self.subnet = f"10.213.{pid % 250}"
        self.bridge = f"kvb{pid}"
        self.names = [f"kvd-{pid}-{i}" for i in range(nodes)]
        self._veths = [(f"kvh{pid}_{i}", f"kvn{pid}_{i}") for i in range(nodes)]
        self._made: list[list[str]] = []  # commands that undo what was made, in reverse order

    @property
    def redis_host(self) -> str:
        return f"{self.subnet}.1"

    def prefix(self, index: int) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.names[index])

    def __enter__(self) -> Namespaces:
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(["link", "del", self.bridge])
            self._ip("addr", "add", f"{self.redis_host}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for i, (name, (host_end, node_end)) in enumerate(zip(self.names, self._veths, strict=True)):
                self._ip("netns", "add", name)
                self._made.append(["netns", "del", name])
                self._ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
                self._ip("link", "set", node_end, "netns", name)
                self._ip("link", "set", host_end, "master", self.bridge, "up")
                self._ip("-n", name, "addr", "add", f"{self.subnet}.{10 + i}/24", "dev", node_end)
                self._ip("-n", name, "link", "set", node_end, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self._undo()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._undo()

    def _undo(self) -> None:
        while self._made:
            subprocess.run(["ip", *self._made.pop()], capture_output=True, check=False)

    @staticmethod
    def _ip(*argv: str) -> None:
        done = subprocess.run(["ip", *argv], capture_output=True, text=True)
        if done.returncode != 0:
            raise KVDepotError(f"--netns: ip {' '.join(argv)} failed: {done.stderr.strip()}")
