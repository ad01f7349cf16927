"""``kvdepot bench mp``: multi-process mode against its references, measured in one run:

    memcpy          one plain pinned copy of the same bytes (host<->GPU; a host memcpy on CPU)
    in-process      CacheEngine.store / retrieve on the pool
    multi-process   a ``kvdepot server`` subprocess copying in/out of the mapped pool
    zmq echo        a PING's frames echoed by a plain pyzmq ROUTER over ipc://, no kvdepot in it:
                    the round trip's floor (``zmq_echo``), p50 / p99 in us
    ping rtt        PING round trips through kvdepot's client and server (a handler that does
                    nothing): p50 / p99 in us; ``ratio`` the floor's p50 over this one
    lookup rtt      LOOKUP (+ fire-and-forget RELEASE) round trips, as the scheduler makes them

Each copy row has its median time per operation (``ms/op``): multi-process minus in-process is the
fixed cost of a request (round trip, events, the server's bookkeeping), the rest scales with bytes.
Timing starts once the host arena is fully allocated and full (for the server too: pinning its
arena in the background would otherwise overlap the timed copies), and a timed store that drops
chunks is refused.

    run(args) -> list[dict]      one row per measurement, with ratios to memcpy and in-process

``args`` is the namespace of ``add_arguments``; attributes it lacks take the defaults, so
``run(argparse.Namespace())`` works. On CPU the pool is a shared file the server maps (numbers
are lower). Blocks are picked in random order, as a real prefix lands in a fragmented pool.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvdepot.bench.common import device_name, median_seconds, memcpy_ceiling
from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.bench.server_proc import running_server
from kvdepot.bench.zmq_echo import echo_rtt, echo_server, percentiles_us
from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.layout import PoolLayout
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import shared_cpu_pool
from kvdepot.server.remote import RemoteEngine

DEFAULTS: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu", "layers": 32, "kv_heads": 8,
                            "head_dim": 128, "tokens_per_block": 32, "chunk_size": 256, "blocks": None, "reps": 5,
                            "lookups": 2000}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=DEFAULTS["device"], choices=("cpu", "cuda"),
                        help="where the pool lives (cpu: a shared file the server maps; figures are host memcpy)")
    helps = {"layers": "layers of the pool", "kv_heads": "KV heads per layer", "head_dim": "elements per head",
             "tokens_per_block": "tokens per pool block", "chunk_size": "tokens per kvdepot chunk",
             "reps": "timed operations of each kind (the median is shown)"}
    for name, text in helps.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name], help=f"{text} (default: {DEFAULTS[name]})")
    parser.add_argument("--blocks", type=int, default=None, help="blocks moved per operation (default on CUDA: 8192 tokens' worth, as bench transfer; 16 on CPU)")
    parser.add_argument("--lookups", type=int, default=DEFAULTS["lookups"], help="LOOKUP round trips timed")
    add_output_arguments(parser)


def _opt(args: Any, name: str) -> Any:
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


def run(args: Any) -> list[dict]:
    device = torch.device(_opt(args, "device"))
    B, reps = _opt(args, "tokens_per_block"), _opt(args, "reps")
    bpc = _opt(args, "chunk_size") // B
    # An 8K-token prefix per operation on CUDA, the size bench transfer moves: a request's fixed
    # cost (~0.7 ms on the H200) is then weighed against a realistic load, not a 64-block one.
    moved = _opt(args, "blocks") or (max(bpc, 8192 // B) if device.type == "cuda" else 16)
    moved -= moved % bpc
    elems = _opt(args, "kv_heads") * B * _opt(args, "head_dim")
    shape = (moved * 2, _opt(args, "layers"), 2, elems)
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp"))
    report = Report(args, steps=5, device=device, name="bench mp",
                    bars=Bars(("mode", "op"), ("GB/s",), "GB/s"))
    report.table(f"kvdepot bench mp — {device_name(device)}", mode=13, op=10, pool=4)
    try:
        pool = (torch.empty(shape, dtype=torch.bfloat16, device=device) if device.type == "cuda"
                else shared_cpu_pool(str(workdir / "pool"), shape, torch.bfloat16))
        pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
        layout = PoolLayout.from_pool(pool, B, bpc * B)
        nbytes = moved * layout.bytes_per_block

        def row(mode: str, op: str, **figures: Any) -> dict[str, Any]:
            base = {"device": device_name(device), "block MiB": layout.bytes_per_block / 2**20, "blocks": moved,
                    "mode": mode, "op": op, "pool": None, "GB/s": None, "ms/op": None, "ratio": None,
                    "vs in-process": None, "p50 us": None, "p99 us": None}
            return report.add({**base, **figures})

        # Two batches of room: the warm-up fills the arena (pinned in the background) and later
        # stores evict, the steady state of a busy cache.
        config = load_config(chunk_size=bpc * B, host_capacity_gb=(2 * nbytes + 1) / 1e9)
        with report.step("memcpy"):
            h2d, d2h, _both = memcpy_ceiling(nbytes, device, reps)
        ceiling = {"store": d2h, "retrieve": h2d}
        for op in ceiling:
            row("memcpy", op, **{"GB/s": ceiling[op], "ms/op": nbytes / ceiling[op] / 1e6, "ratio": 1.0})
        with report.step("in-process"):
            engine = CacheEngine(layout, config)
            engine.register_pool(pool)
            engine.wait_arena()
            local = _rates(engine, moved, device, reps)
            engine.close()
        for op in ceiling:
            row("in-process", op, **{"GB/s": local[op], "ms/op": nbytes / local[op] / 1e6,
                                     "ratio": local[op] / ceiling[op], "vs in-process": 1.0})
        with report.step("start a server"), running_server(
                "--chunk-size", str(bpc * B), "--host-capacity-gb", repr(config.host_capacity_gb)) as url:
            client = DepotClient(url, timeout_s=30.0, name="bench")
            try:
                remote = RemoteEngine(client, pool, B, model_id="bench", config=config)
                with report.step("multi-process copies"):
                    multi = _rates(remote, moved, device, reps)
                for op in ceiling:
                    row("multi-process", op, pool=remote.exported.kind, **{
                        "GB/s": multi[op], "ms/op": nbytes / multi[op] / 1e6, "ratio": multi[op] / ceiling[op],
                        "vs in-process": multi[op] / local[op]})
                with report.step("round trips"), echo_server() as echo:
                    floor = echo_rtt(echo, w.request_frames(p.OP_OF[p.Ping], 1, p.Ping()), _opt(args, "lookups"))
                    row("zmq echo", "ping rtt", **floor)
                    ping = _rtt(client, None, _opt(args, "lookups"))
                    row("multi-process", "ping rtt", ratio=floor["p50 us"] / ping["p50 us"], **ping)
                    row("multi-process", "lookup rtt", **_rtt(client, remote.chunk_keys(list(range(moved * B))),
                                                             _opt(args, "lookups")))
                remote.close()
            finally:
                client.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report.finish()


def _rates(engine: Any, moved: int, device: torch.device, reps: int) -> dict[str, float]:
    """Store fresh chunks from random blocks; load stored ones into other random blocks."""
    rng, counter = random.Random(0), iter(range(1 << 40))
    rows = engine.layout.num_blocks
    B = engine.layout.tokens_per_block

    def batch() -> tuple[list[bytes], list[int]]:
        return engine.chunk_keys([next(counter) % 100_000 for _ in range(moved * B)]), rng.sample(range(rows), moved)

    stored: list[list[bytes]] = []

    def store(keys: list[bytes], block_ids: list[int]) -> None:
        handle = engine.store(keys, block_ids)
        handle.wait()
        if handle.chunks != len(keys):  # dropped: the arena is not all there yet (or all pinned)
            raise _Dropped(f"a store placed {handle.chunks} of {len(keys)} chunks; refusing to time it")
        stored.append(keys)

    # Fill the arena twice over, so timed stores evict as in steady state, and go on until all
    # of it is allocated and full: a server pins its arena on a helper thread from its first
    # store, and cudaHostAlloc next to timed copies would slow them (stores meanwhile may drop).
    deadline, warm = time.monotonic() + 120, 0
    while warm < 4 or not _host_full(engine):
        with contextlib.suppress(_Dropped):
            store(*batch())
        warm += 1
        if time.monotonic() > deadline:
            raise RuntimeError("the host arena did not fill within 120 s")
    # Keys and block ids are drawn before the clock starts: hashing is not the transfer's cost.
    batches = [batch() for _ in range(reps)]
    nbytes = moved * engine.layout.bytes_per_block
    store_s = median_seconds(lambda: store(*batches.pop()), device, reps, warmup=0)
    held, targets = stored[-1], rng.sample(range(rows), moved)

    def retrieve() -> None:
        if engine.retrieve(held, targets) != moved * B:  # a miss would time as infinitely fast
            raise RuntimeError("benchmark retrieve found its chunks evicted")

    load_s = median_seconds(retrieve, device, reps)
    return {"store": nbytes / store_s / 1e9, "retrieve": nbytes / load_s / 1e9}


class _Dropped(RuntimeError):
    """A store placed fewer chunks than it was given."""


def _host_full(engine: Any) -> bool:
    """Every slot of the (in-process or server) engine's host arena is allocated and holds a chunk."""
    stats = engine.stats()
    if isinstance(stats, p.StatsReply):
        figures = stats.shards[0].figures if stats.shards else {}
        return figures.get("host_chunks", 0) >= figures.get("host_capacity_chunks", 1)
    return stats is not None and stats.host_chunks >= stats.host_capacity_chunks


def _rtt(client: DepotClient, keys: list[bytes] | None, n: int) -> dict[str, Any]:
    """PING round trips (``keys`` None), or LOOKUPs of ``keys`` each followed by its RELEASE."""
    blob, samples = w.join_keys(keys or []), []
    for i in range(n):
        started = time.perf_counter()
        client.call(p.Ping() if keys is None else p.Lookup(i, blob))
        samples.append((time.perf_counter() - started) * 1e6)
        if keys is not None:
            client.submit(p.Release(i))
    return percentiles_us(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvdepot bench mp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
