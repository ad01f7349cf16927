"""``kvdepot bench events``: caller-side cost of one KV-event sink call at a realistic rate (one
call per ms), events off vs on: what a tier's store/eviction report and an edge's describe add to
the caller's thread (CPU; the publisher's own thread is not timed). Was tools/kv_events_cost.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvdepot.bench.report import Bars, Report, add_output_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=300, help="timed calls of each kind, one per ms (the median is shown)")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length that describe() is given")
    add_output_arguments(parser)


def median_us(fn: Callable[[int], None], n: int = 300) -> float:
    out = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - start)
        time.sleep(0.001)
    return statistics.median(out) * 1e6


def run(args: argparse.Namespace) -> list[dict]:
    from kvdepot.events.base import NULL_SINK, EventSpace, Medium
    from kvdepot.events.publisher import KVEventPublisher

    space = EventSpace("m", "", 256, 16)
    tokens = list(range(args.tokens))
    keys = [i.to_bytes(16, "big") for i in range(max(1, args.tokens // 256))]
    report = Report(args, steps=2, name="bench events", bars=Bars(("events",), ("stored us", "describe us"), "us per call"))
    report.table(f"kvdepot bench events — caller time per sink call, median of {args.calls}, one call per ms", events=6)
    pub = KVEventPublisher("inproc://kv-events-cost")
    try:
        for name, sink in (("off", NULL_SINK), ("on", pub)):
            with report.step(f"events {name}"):
                stored = median_us(lambda i, s=sink: s.stored(Medium.HOST, (keys[i % len(keys)],)), args.calls)
                described = median_us(lambda i, s=sink: s.describe(keys, tokens, space), args.calls)
            report.add({"events": name, "stored us": stored, "describe us": described, "tokens": args.tokens})
    finally:
        pub.close()
    return report.finish()
