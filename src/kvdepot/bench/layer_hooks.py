"""``kvdepot bench hooks``: what a load by layer costs the forward's host thread, per layer hook,
in-process against server mode (LAYERS round trips, or the progress page) — on a CPU.

A forward of ``--layers`` layers calls its hook for layer ``l`` (TensorRT-LLM's
``wait_for_layer_load``), then issues that layer: ``--forward-us`` of GIL-held Python in
``--launches`` slices, the GIL released between them as torch's op calls release it (a thread
waiting for the GIL gets it there, not only at the interpreter's 5 ms switch interval). The
load's copies are simulated: per layer, a "driver call" of ``--issue-us`` of which ``--gil-us``
hold the GIL (address lists) and the rest sleeps (``cuMemcpyBatchAsync``):

    in-process   ``transfer.layered.LayeredLoad`` in this process: ``--ahead`` layers at the load,
                 the rest on a ``LayerIssuer`` thread beside the forward (the engine's default)
    in-process-hooks   the same, each hook enqueueing one more itself (its own driver call, on the
                 forward's thread: config ``load_layer_thread: false``)
    mp-rpc       a server subprocess (``hooks_server``: the real loop, LAYERS handler, issuer and
                 ``start_early``) answers the load after layer 0 and records the rest on its
                 issuer; each hook waits as ``RemoteProgress`` does with LAYERS (config
                 ``layer_progress: rpc``)
    mp-page      the same server, the hooks reading the registration's progress page (``auto``);
                 the server answers before layer 0 and records every layer on its issuer

Per row (medians over ``--loads`` loads): ``start ms`` (asking for the load to the forward's
first hook: in-process the first ``--ahead`` layers' issue, MP the RETRIEVE round trip), ``hooks
ms`` (the forward's time inside its hooks), ``us/hook``, ``LAYERS/load``, ``waits/load`` (hooks
that began before the server had recorded their layer) and their ``lag us`` (how long after the
server's record the hook returned), ``issue us/layer`` (the pace at which the layers' copies were
enqueued: in MP, by the server's issuer beside its LAYERS traffic) and ``forward ms`` (first hook to the end of the last layer) with its ratio to in-process in the
same run, the reference. The server issue runs beside the forward in MP, so a forward that is
quicker than ``--issue-us`` per layer waits for it there; a slower one should not wait at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvdepot.bench.common import non_negative
from kvdepot.bench.hooks_server import spin
from kvdepot.bench.report import Report, add_output_arguments
from kvdepot.bench.subprocs import wait_or_kill
from kvdepot.server import protocol as p
from kvdepot.server.client import DepotClient
from kvdepot.server.layer_follow import FollowStats, RemoteProgress, Watch
from kvdepot.server.progress_page import PAGE_SUPPORTED, ProgressPage
from kvdepot.transfer.layered import LayeredLoad, LayerIssuer

MODES = ("in-process", "in-process-hooks", "mp-rpc", "mp-page")
LOCAL = ("in-process", "in-process-hooks")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32, help="layers of the model (default 32: Llama-8B)")
    parser.add_argument("--issue-us", type=float, default=500.0,
                        help="host time of one layer's driver call (default 500: ~1024 blocks on the H200 host, run Q)")
    parser.add_argument("--gil-us", type=float, default=100.0, help="of which the GIL is held (default 100)")
    parser.add_argument("--forward-us", default="100,300,1000", help="GIL-held host time the forward spends per layer, comma-separated")
    parser.add_argument("--launches", type=non_negative, default=8,
                        help="slices of a layer's forward, the GIL released between them as an op call does "
                             "(default 8; 0: held throughout)")
    parser.add_argument("--ahead", type=int, default=4, help="in-process modes: layers enqueued ahead (config load_layers_ahead; a server enqueues none before its reply)")
    parser.add_argument("--loads", type=int, default=10, help="loads per mode and round (medians over all rounds)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the modes, alternating")
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    add_output_arguments(parser)


class _Stream:
    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


class _Event:
    def record(self, stream: object = None) -> None:
        pass


def _in_process(args: argparse.Namespace, forward_us: float, helper: LayerIssuer | None) -> dict[str, Any]:
    """One load's figures with the copies issued in this process: by ``helper``'s thread, or
    (None) from the forward's hooks."""
    stamps = np.zeros(args.layers, dtype=np.int64)

    def issue() -> Iterator[int]:
        for layer in range(args.layers):
            spin(args.gil_us)
            time.sleep(max(0.0, args.issue_us - args.gil_us) / 1e6)
            stamps[layer] = time.monotonic_ns()
            yield layer

    asked = time.perf_counter_ns()
    load = LayeredLoad(issue(), [_Event() for _ in range(args.layers)], None, lambda exc: None, args.ahead)
    load.issue_through(args.ahead)  # what start_load_kv enqueues
    if helper is not None:  # as InflightTransfers.start_layered hands it over
        load.helped = True
        helper.submit(load.issue_rest)
    stream, hooks = _Stream(), 0
    started = time.perf_counter_ns()
    for layer in range(args.layers):
        before = time.perf_counter_ns()
        load.wait_layer(layer, stream)
        hooks += time.perf_counter_ns() - before
        _forward(forward_us, args.launches)
    if helper is not None:
        helper.drain()
    return {"start": started - asked, "hooks": hooks, "forward": time.perf_counter_ns() - started, "asks": 0, "lags": [],
            "pace": _pace(stamps)}


def _forward(us: float, launches: int) -> None:
    """One layer's host work: ``us`` of GIL-held Python, released between ``launches`` slices."""
    for _ in range(max(1, launches)):
        spin(us / max(1, launches))
        if launches:
            time.sleep(0)  # releases the GIL, as a torch op call does around its launch


def _pace(stamps: np.ndarray) -> float:
    """ns per layer between the records of layers 1 and L-1 (layer 0's may precede the reply in MP)."""
    return float(stamps[-1] - stamps[1]) / (len(stamps) - 2)


@contextlib.contextmanager
def _server(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, np.ndarray]]:
    url, stamps_path = f"ipc://{workdir}/hooks.sock", workdir / "stamps"
    stamps = np.memmap(stamps_path, dtype=np.int64, mode="w+", shape=(args.layers,))
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.hooks_server", url, str(args.layers),
                             str(args.issue_us), str(args.gil_us), str(stamps_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "KVDEPOT_LOG_LEVEL": "WARNING"})
    try:
        yield url, stamps
    finally:
        proc.terminate()
        wait_or_kill(proc, 20)


def _register(client: DepotClient, layers: int, page: ProgressPage | None) -> bool:
    desc = p.CudaIpcPool(b"\0" * 64, 0, 1, "simulated", layer_events=(b"",) * layers,
                         progress_page=page.path if page is not None else "")
    msg = p.Register("hooks", 0, 1, 32, 1, layers, 2, 1, "bfloat16", 4 * layers, desc)
    try:
        reply, _ = client.call(msg, handshake=True, timeout=30.0)
    finally:
        if page is not None:
            page.unlink()
    return bool(reply.progress_page)  # type: ignore[attr-defined]


def _remote(args: argparse.Namespace, client: DepotClient, page: ProgressPage | None, stamps: np.ndarray,
            forward_us: float) -> dict[str, Any]:
    """One load through the server, followed as ``RemoteEngine._progress`` follows it."""
    stats = FollowStats()
    asked = time.perf_counter_ns()
    deadline = time.monotonic_ns() + int(client.timeout_s * 0.5e9)
    reply, _ = client.call(p.Retrieve(b"", [0], deadline_ns=deadline, by_layer=True, early=True))
    load_id = reply.load_id  # type: ignore[attr-defined]
    watch = Watch(page, load_id, deadline + 100_000_000, lambda: client.ready) if page is not None else None
    follow = RemoteProgress(lambda through: client.submit(p.Layers(load_id, through)), reply.layers_ready,  # type: ignore[attr-defined]
                            args.layers, client.timeout_s, watch, stats)
    hooks, lags = 0, []
    started = time.perf_counter_ns()
    for layer in range(args.layers):
        before, since = time.perf_counter_ns(), time.monotonic_ns()
        follow.through(layer)
        hooks += time.perf_counter_ns() - before
        heard, recorded = time.monotonic_ns(), int(stamps[layer])  # this load's record: it precedes the news
        if recorded > since:  # the server recorded the layer while the hook waited for it
            lags.append(heard - recorded)
        _forward(forward_us, args.launches)
    forward = time.perf_counter_ns() - started
    return {"start": started - asked, "hooks": hooks, "forward": forward, "asks": stats.asks, "lags": lags,
            "pace": _pace(stamps)}


def _row(mode: str, forward_us: float, layers: int, loads: list[dict[str, Any]], reference: float | None) -> dict[str, Any]:
    med = {k: statistics.median(load[k] for load in loads) for k in ("start", "hooks", "forward", "asks", "pace")}
    lags = [lag for load in loads for lag in load["lags"]]
    return {"mode": mode, "forward us/layer": forward_us, "start ms": med["start"] / 1e6, "hooks ms": med["hooks"] / 1e6,
            "us/hook": med["hooks"] / 1e3 / layers, "LAYERS/load": med["asks"],
            "waits/load": len(lags) / len(loads), "lag us": statistics.median(lags) / 1e3 if lags else float("nan"),
            "issue us/layer": med["pace"] / 1e3, "forward ms": med["forward"] / 1e6, "forward/in-process": med["forward"] / reference if reference else float("nan")}


def _connect(url: str, layers: int, page: ProgressPage | None) -> DepotClient:
    client = DepotClient(url, timeout_s=2.0, heartbeat_s=3600.0, name="bench-hooks", connect=False)
    deadline = time.monotonic() + 60
    while not client.connect():
        if time.monotonic() > deadline:
            raise RuntimeError("the hooks server did not start in 60 s")
        time.sleep(0.1)
    if not _register(client, layers, page) and page is not None:
        raise RuntimeError("the server did not map the progress page")
    return client


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: {', '.join(sorted(unknown))} not among {', '.join(MODES)}")
    if "mp-page" in modes and not PAGE_SUPPORTED:
        modes.remove("mp-page")
    speeds = [float(v) for v in args.forward_us.split(",") if v]
    report = Report(args, steps=args.rounds * len(modes) * len(speeds), name="hooks")
    report.note(f"{args.layers} layers; simulated issue {args.issue_us:g} us per layer ({args.gil_us:g} holding the GIL), "
                f"{args.ahead} ahead; {args.rounds} rounds of {args.loads} loads per mode, modes alternating; "
                f"{os.cpu_count()} CPUs")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-hooks-", dir="/tmp"))
    loads: dict[tuple[str, float], list[dict[str, Any]]] = {(m, f): [] for m in modes for f in speeds}
    try:
        with _server(args, workdir) as (url, stamps):
            pages = {m: ProgressPage.create() if m == "mp-page" else None for m in modes if m not in LOCAL}
            helper = LayerIssuer("kvdepot-layers")
            clients = {m: _connect(url, args.layers, page) for m, page in pages.items()}
            try:
                for _ in range(args.rounds):  # the modes alternate: a busy host slows each of them alike
                    for forward_us in speeds:
                        for mode in modes:
                            with report.step(f"{mode} {forward_us:g}"):
                                client = clients.get(mode)
                                for n in range(args.loads + 1):  # one warm-up load
                                    one = (_in_process(args, forward_us, helper if mode == "in-process" else None)
                                           if client is None else _remote(args, client, pages[mode], stamps, forward_us))
                                    if n:
                                        loads[mode, forward_us].append(one)
            finally:
                helper.close()
                for client in clients.values():
                    client.close()
                for page in pages.values():
                    if page is not None:
                        page.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.table("forward host time in the layer hooks of a load by layer (medians per load)")
    for forward_us in speeds:
        reference = statistics.median(one["forward"] for one in loads.get(("in-process", forward_us), [{"forward": 0}]))
        for mode in modes:
            report.add(_row(mode, forward_us, args.layers, loads[mode, forward_us], reference))
    return report.finish()

