"""The transport's floor for ``bench mp``: plain pyzmq round trips over ipc://, no kvdepot in them.

    with echo_server() as url:
        echo_rtt(url, frames, n) -> {"p50 us", "p99 us"}
    percentiles_us(samples) -> {"p50 us", "p99 us"}     the same figures of any round trips

A ROUTER in a subprocess (``python -m kvdepot.bench.zmq_echo URL``) sends every message straight
back; a DEALER here sends the given frames (a PING's header and body) and blocks in ``recv``.
kvdepot's own PING round trip, measured in the same run, over this floor is what its client and
server add to the library's: locks, the reply's future, poll wake-ups, parsing and dispatch.
What is left of the floor is ZMQ's: each message crosses its I/O thread on either side, four
thread hand-offs per round trip (issue 19: the MP lookup's cost before a hit's forward).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import zmq

from kvdepot.bench.subprocs import terminate

READY = b"ready\n"


def serve(url: str) -> None:
    """Echo every message on a ROUTER bound at ``url`` until the process is terminated."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(url)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


@contextlib.contextmanager
def echo_server(timeout_s: float = 30.0) -> Iterator[str]:
    """Yield the ipc:// URL of a fresh echo subprocess once it is bound; stop it (and remove its
    socket's directory) on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-echo-", dir="/tmp"))  # short: socket paths are limited
    url = f"ipc://{workdir}/echo.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.zmq_echo", url],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        # The child prints READY once bound (a line, or EOF if it died first); the deadline is
        # the caller's, enforced by killing the child, which ends the read.
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        line = proc.stdout.readline()
        timer.cancel()
        if line != READY:
            raise RuntimeError(f"the zmq echo server did not start (exit code {proc.poll()})")
        yield url
    finally:
        terminate(proc, 10)
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(workdir, ignore_errors=True)


def echo_rtt(url: str, frames: Sequence[bytes], n: int, timeout_s: float = 5.0) -> dict[str, float]:
    """p50 / p99 in microseconds of ``n`` round trips of ``frames`` through the echo at ``url``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(url)
    samples = []
    try:
        for _ in range(n):
            started = time.perf_counter()
            sock.send_multipart(frames)
            sock.recv_multipart()  # zmq.Again after timeout_s: the echo is gone
            samples.append((time.perf_counter() - started) * 1e6)
    finally:
        sock.close(0)
        ctx.term()
    return percentiles_us(samples)


def percentiles_us(samples: list[float]) -> dict[str, float]:
    """The p50 and p99 of round trips in microseconds, as ``bench mp`` reports every round trip."""
    samples, n = sorted(samples), len(samples)
    return {"p50 us": samples[n // 2], "p99 us": samples[min(n - 1, n * 99 // 100)]}


def main(argv: list[str]) -> int:
    """``python -m kvdepot.bench.zmq_echo URL``; a bad argument list or URL: one line, status 2."""
    if len(argv) != 1:
        print("usage: python -m kvdepot.bench.zmq_echo URL (e.g. ipc:///tmp/echo.sock)", file=sys.stderr)
        return 2
    try:
        serve(argv[0])
    except zmq.ZMQError as exc:
        print(f"zmq_echo: cannot bind {argv[0]!r}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
