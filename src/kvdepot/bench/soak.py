"""``kvdepot bench soak``: client processes against a server while everything around them fails.

    kvdepot bench soak [--seconds 120] [--clients 8] [--fault-every 6]

Starts a real ``redis-server`` on loopback, a ``kvdepot server`` (tiny host tier, a disk tier
and Redis behind it, so chunks travel through every tier) and ``--clients`` client processes
(``soak_client``: half with shared-file pools the server maps, half sending bytes), then, one
every ``--fault-every`` seconds in shuffled rounds: the server killed with -9 and restarted; the
server stopped (SIGSTOP) for longer than the session timeout, then continued (SIGCONT); a client
killed with -9 and replaced; Redis killed with -9 and restarted (each at least once, however
short the run). Every loaded byte is checked
against what was stored (a chunk's KV is a function of its key); loads that bring less than
their lookup promised are counted as short (a fault in between is allowed to cause that; wrong
bytes never are). At the end the clients stop cleanly and, once killed clients' sessions are
reaped, the server must hold no sessions, mappings, prefetches, leases or pinned chunks and no
client's shared pool file may be left (but for a client killed while no running server knew its
pool — before it registered, or killed and then its server too before the session was reaped: no
server can remove that file, so the soak removes it and counts it apart). The figures are
printed; wrong bytes or anything left over is an error (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.bench.soak_client import Counts, pool_path
from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server.client import DepotClient

FAULTS = ("server kill -9", "server SIGSTOP", "client kill -9", "redis kill -9")
SESSION_TIMEOUT_S = 2.0
_SERVER_ARGS = ("--chunk-size", "16", "--host-capacity-gb", "0.0002", "--disk-capacity-gb", "0.0004",
                "--session-timeout-s", str(SESSION_TIMEOUT_S), "--lease-timeout-s", "5", "--log-level", "WARNING")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the clients run under faults")
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--fault-every", type=float, default=6.0, help="seconds between two faults")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, the faults schedule and the clients' choices")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvd-soak-", dir="/tmp"))  # short: socket paths are limited
    rng = random.Random(args.seed)
    procs = _Procs(workdir)
    faults: Counter[str] = Counter()
    try:
        procs.start_redis()
        procs.start_server()
        for i in range(args.clients):
            procs.start_client(i, "shm" if i % 2 == 0 else "bytes", rng.getrandbits(32))
        procs.wait_ready()
        start = time.monotonic()
        order: list[str] = []
        # every kind of fault at least once, however short the run
        while (left := args.seconds - (time.monotonic() - start)) > 0 or len(faults) < len(FAULTS):
            time.sleep(min(args.fault_every, max(left, 0.5)))
            if time.monotonic() - start >= args.seconds and len(faults) == len(FAULTS):
                break
            if not order:
                order = rng.sample(FAULTS, len(FAULTS))
            fault = order.pop()
            with open(workdir / "faults.log", "a") as log:
                log.write(f"{time.time():.3f} {fault}\n")
            procs.inject(fault, rng)
            faults[fault] += 1
        ran_s = time.monotonic() - start
        procs.stop_clients()
        end = procs.final_figures()
    finally:
        procs.close()
    counts = _totals(workdir)
    if not os.environ.get("KVD_SOAK_KEEP"):  # KVD_SOAK_KEEP=1: keep the logs (the path is printed)
        shutil.rmtree(workdir, ignore_errors=True)
    figures = {"clients": args.clients, "seconds": round(ran_s, 1), "incarnations": procs.incarnations,
               "pool files of clients no server knew": procs.orphans,
               **{f"faults: {name}": faults[name] for name in FAULTS}, **counts, **end}
    _print(figures)
    _write(args, figures)
    leftover = {k: v for k, v in end.items() if v}
    if counts["wrong_bytes"] or counts["late_bytes"] or leftover:
        raise KVDepotError(f"soak failed: {counts['wrong_bytes']} wrong bytes, {counts['late_bytes']} written late; "
                           f"left at the end: {leftover or 'nothing'}")
    return figures


class _Procs:
    """The soak's processes: redis-server, the kvdepot server and the clients (with restarts)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.url = f"ipc://{workdir}/s.sock"
        self.redis_port = _free_port()
        self.redis: subprocess.Popen | None = None
        self.server: subprocess.Popen | None = None
        self.clients: dict[int, subprocess.Popen] = {}
        self.modes: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.incarnations = 0
        self.orphans = 0  # pool files of killed clients that no running server can know of
        self._killed: list[str] = []  # names of clients killed since the server last started
        self._servers = 0

    # ---- starting -------------------------------------------------------------------------------
    def start_redis(self) -> None:
        redis = shutil.which("redis-server")
        if redis is None:
            raise KVDepotError("bench soak needs redis-server on PATH (apt-get install redis-server)")
        self.redis = subprocess.Popen(
            [redis, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.redis_port, self.redis)

    def start_server(self) -> None:
        self._servers += 1
        log = self.workdir / f"server-{self._servers}.log"
        with open(log, "wb") as sink:
            self.server = subprocess.Popen(
                [sys.executable, "-m", "kvdepot.server", "--url", self.url, *_SERVER_ARGS,
                 "--disk-path", str(self.workdir / "disk"), "--remote-url", f"redis://127.0.0.1:{self.redis_port}/0"],
                stdout=subprocess.DEVNULL, stderr=sink)
        began = time.monotonic()  # NOTE: a start-up (torch import) took > 120 s at load average 20
        while b"listening on" not in log.read_bytes():
            if self.server.poll() is not None or time.monotonic() - began > 600:
                raise KVDepotError(f"the kvdepot server did not start in {time.monotonic() - began:.0f} s "
                                   f"(exit code {self.server.poll()}): {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def start_client(self, slot: int, mode: str, seed: int) -> None:
        self.incarnations += 1
        self.modes[slot] = mode
        name = self.names[slot] = f"c{slot}-{self.incarnations}"
        with open(self.workdir / f"{name}.log", "wb") as log:
            self.clients[slot] = subprocess.Popen(
                [sys.executable, "-m", "kvdepot.bench.soak_client", self.url, str(self.workdir), name, mode, str(seed)],
                stdout=subprocess.DEVNULL, stderr=log)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until every client has registered (importing torch takes seconds on a busy machine)."""
        deadline = time.monotonic() + timeout_s
        while len(list(self.workdir.glob("c*-*.ready"))) < len(self.clients):
            if time.monotonic() > deadline:
                raise KVDepotError(f"the soak clients did not register within {timeout_s:.0f} s")
            time.sleep(0.1)

    # ---- faults ---------------------------------------------------------------------------------
    def inject(self, fault: str, rng: random.Random) -> None:
        if fault == "server kill -9":
            assert self.server is not None
            # Killed clients whose pools it still maps (not reaped yet): their files die with it.
            pid = self.server.pid
            unreaped = [n for n in self._killed if _mapped(pid, pool_path(self.workdir, n))]
            _kill(self.server)
            self._forget_files(unreaped)
            self._killed.clear()
            self.start_server()
        elif fault == "server SIGSTOP":
            assert self.server is not None
            self.server.send_signal(signal.SIGSTOP)
            time.sleep(SESSION_TIMEOUT_S + 0.5)  # past the session timeout: sessions are reaped on waking
            self.server.send_signal(signal.SIGCONT)
        elif fault == "client kill -9":
            slot = rng.choice(sorted(self.clients))
            pool_file = pool_path(self.workdir, self.names[slot])
            known = self.server is not None and _mapped(self.server.pid, pool_file)
            _kill(self.clients[slot])  # reaped at once: a zombie would still look alive to the server
            self._killed.append(self.names[slot])
            if not known:  # killed before it registered with this server (starting, or after a restart)
                self._forget_files([self.names[slot]])
            self.start_client(slot, self.modes[slot], rng.getrandbits(32))
        else:
            _kill(self.redis)
            time.sleep(1.0)
            self.start_redis()

    def _forget_files(self, names: list[str]) -> None:
        """Remove the pool files of dead clients ``names`` that no running server can know of (so
        none can remove them), counted apart from the files a server should have removed."""
        for name in names:
            path = pool_path(self.workdir, name)
            if path.exists():
                path.unlink()
                self.orphans += 1

    # ---- the end --------------------------------------------------------------------------------
    def stop_clients(self) -> None:
        (self.workdir / "stop").touch()
        for proc in self.clients.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                _kill(proc)

    def final_figures(self) -> dict[str, int]:
        """What the server still holds once every client is gone and silent sessions are reaped."""
        probe = DepotClient(self.url, timeout_s=5.0, heartbeat_s=3600.0, name="soak-probe", log_outages=False)
        pools = pool_path(self.workdir, "*")
        try:
            deadline = time.monotonic() + 4 * SESSION_TIMEOUT_S + 10
            while True:
                stats, _ = probe.call(p.GetStats())
                figures = _holdings(stats)  # type: ignore[arg-type]
                # NOTE: a reaped session's pool file goes after its mapping is closed: wait for both
                figures["shm files left"] = len(list(pools.parent.glob(pools.name)))
                if not any(figures.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            probe.close()
        return figures

    def close(self) -> None:
        for proc in self.clients.values():
            _kill(proc)
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGCONT)
            self.server.terminate()
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                _kill(self.server)
        _kill(self.redis)
        for path in Path("/dev/shm").glob(f"{self.workdir.name}-*"):
            path.unlink(missing_ok=True)


def _mapped(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` mapped (the server maps a client's pool at REGISTER)."""
    try:
        return str(path) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _holdings(stats: p.StatsReply) -> dict[str, int]:
    figures = [shard.figures for shard in stats.shards]
    return {"sessions": stats.sessions - 1, "mappings": stats.mappings, "prefetches": stats.prefetches,
            "leases": int(sum(f.get("live_leases", 0) for f in figures)),
            "pinned chunks": int(sum(f.get("pinned_chunks", 0) for f in figures))}


def _totals(workdir: Path) -> dict[str, int]:
    total = Counter[str]()
    for path in workdir.glob("c*-*.json"):
        with contextlib.suppress(ValueError):  # only a torn write could fail, and writes are atomic
            total.update(json.loads(path.read_text()))
    return {name: total[name] for name in Counts.__dataclass_fields__}


def _print(figures: dict[str, Any]) -> None:
    width = max(len(k) for k in figures)
    print(f"kvdepot bench soak: {figures['clients']} clients for {figures['seconds']} s under faults")
    for key, value in figures.items():
        print(f"  {key.ljust(width)}  {value}")


def _write(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """``--json`` / ``--plot``: the figures as one row each (the plot on a log scale: counts span
    from 0 wrong bytes to millions of bytes checked)."""
    if not (args.json or args.plot):
        return
    report = Report(args, steps=0, bars=Bars(("figure",), ("value",), "count", log=True), name="bench soak")
    report.table("kvdepot bench soak")
    for key, value in figures.items():
        report.add({"figure": key, "value": value})
    report.finish()


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
    if proc is not None:
        proc.wait(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise KVDepotError(f"redis-server did not start on port {port}")
