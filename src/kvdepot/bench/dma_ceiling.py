"""``kvdepot bench dma``: what the copy engines and the driver do with scattered blocks, no engine.

The ceiling of ``bench transfer``'s batch rows: the same kind of operation (``--blocks`` random,
non-adjacent pool blocks of ``--block-kib`` each, to or from one pinned buffer) handed to
``cuMemcpyBatchAsync`` in the batch mover's growing windows, with every copy list built before the
clock starts — so whatever a batch row loses below this one is kvdepot's host work, and whatever
this row loses below 1.0 is the hardware's and the driver's. Each timed operation is paired with
a plain pinned copy of the same bytes, as in ``bench transfer``; ``both`` is a load and a store
issued interleaved from one thread on two streams, against both directions of memcpy at once.
``engines only``: the copies queued behind a GPU sleep, then timed by events on the GPU (no host
time at all), with the host time the driver calls took.

Measured on the H200 (issue 19, runs Y and AG): 0.99-1.00 of memcpy either way for 256 KiB, 1 MiB
and 4 MiB blocks, 1.00-1.05 both at once, 0.7-1.6 us of driver time per copy — while kvdepot's
256 KiB rows read 0.7-0.9: the gap is host work before the first copy, not the copy engines.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvdepot.bench.common import Memcpy, paired_seconds, positive, size_list
from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.transfer import cuda_batch
from kvdepot.transfer.batch import FIRST_WINDOW_BYTES, WINDOW_BYTES, window_bounds
from kvdepot.transfer.plan import CopyList


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-kib", type=size_list("KiB", "256,1024"), default="256,1024,4096",
                        help="block sizes in KiB, comma-separated")
    parser.add_argument("--blocks", type=positive, default=256, help="blocks per operation (issue 19: 256)")
    parser.add_argument("--reps", type=positive, default=21, help="timed pairs per row (the median ratio is shown)")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available() or not cuda_batch.available():
        raise SystemExit("bench dma: needs a CUDA device whose driver has cuMemcpyBatchAsync_v2 (CUDA 13 drivers)")
    sizes = [kib << 10 for kib in args.block_kib]
    report = Report(args, steps=len(sizes), device=torch.device("cuda"), name="bench dma",
                    bars=Bars(("block KiB", "op"), ("ratio",), "of memcpy"))
    report.table(f"kvdepot bench dma — {args.blocks} random blocks per operation, lists built before the clock, "
                 "growing windows; ratio = median of paired (memcpy of the same bytes / operation)")
    for size in sizes:
        with report.step(f"{size >> 10} KiB"):
            for op, ratio, host_us in _measure(size, args.blocks, args.reps):
                report.add({"block KiB": size >> 10, "blocks": args.blocks, "op": op, "ratio": ratio,
                            "driver us": host_us})
    return report.finish()


def _measure(block: int, blocks: int, reps: int) -> list[tuple[str, float, float]]:
    device = torch.device("cuda")
    pool = torch.empty((blocks * 3, block), dtype=torch.uint8, device=device)
    host = torch.empty(blocks * block, dtype=torch.uint8, pin_memory=True)
    ids = np.array(random.Random(0).sample(range(blocks * 3), blocks), dtype=np.int64)
    pool_at = pool.data_ptr() + ids * block
    host_at = host.data_ptr() + np.arange(blocks, dtype=np.int64) * block
    to_host, to_pool = _listing(host_at, pool_at, block), _listing(pool_at, host_at, block)
    windows = window_bounds(to_host.sizes, WINDOW_BYTES, FIRST_WINDOW_BYTES)
    down, up = torch.cuda.Stream(device), torch.cuda.Stream(device)
    copies = Memcpy(blocks * block, device)

    def issue(listing: CopyList, stream: torch.cuda.Stream) -> Callable[[], None]:
        return lambda: [cuda_batch.memcpy_batch(listing, lo, hi, stream.cuda_stream) for lo, hi in windows]

    def both() -> None:
        for lo, hi in windows:  # interleaved from one thread, as an engine's two directions would be
            cuda_batch.memcpy_batch(to_host, lo, hi, down.cuda_stream)
            cuda_batch.memcpy_batch(to_pool, lo, hi, up.cuda_stream)

    rows = []
    for op, fn, ceiling in (("store", issue(to_host, down), copies.d2h), ("retrieve", issue(to_pool, up), copies.h2d),
                            ("both", both, copies.both)):
        _, _, ratio = paired_seconds(fn, ceiling, device, reps)
        rows.append((op, ratio, float("nan")))
    for op, listing, ceiling in (("store, engines only", to_host, copies.d2h), ("retrieve, engines only", to_pool, copies.h2d)):
        rows.append((op, *_engines_only(issue(listing, down), ceiling, down)))
    return rows


def _listing(dst: np.ndarray, src: np.ndarray, size: int) -> CopyList:
    table = np.empty((3, len(dst)), dtype=np.int64)
    table[0], table[1], table[2] = dst, src, size
    return CopyList(table)


def _engines_only(issue: Callable[[], None], ceiling: Callable[[], None], stream: torch.cuda.Stream,
                  reps: int = 11) -> tuple[float, float]:
    """(median of memcpy GPU time / the operation's GPU time, median host us of its driver calls),
    the operation queued behind a GPU sleep so that all of it is enqueued before any copy runs."""
    ratios, host = [], []
    for _ in range(reps):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms: longer than any issue
            marks[0].record(stream)
            t0 = time.perf_counter()
            issue()
            host.append((time.perf_counter() - t0) * 1e6)
            marks[1].record(stream)
            marks[2].record(stream)
            ceiling()
            marks[3].record(stream)
        torch.cuda.synchronize()
        ratios.append(marks[2].elapsed_time(marks[3]) / marks[0].elapsed_time(marks[1]))
    return statistics.median(ratios), statistics.median(host)
