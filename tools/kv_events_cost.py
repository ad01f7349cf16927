"""Caller-side cost of one KV-event sink call at a realistic rate (one call per ms), events off
vs on: what a tier's store/eviction report and an edge's describe add to the caller's thread.

    PYTHONPATH=src python3 tools/kv_events_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from kvdepot.events.base import NULL_SINK, EventSpace, Medium
from kvdepot.events.publisher import KVEventPublisher


def median_us(fn: Callable[[int], None], n: int = 300) -> float:
    out = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - start)
        time.sleep(0.001)
    return statistics.median(out) * 1e6


def main() -> None:
    space = EventSpace("m", "", 256, 16)
    tokens = list(range(8192))
    keys = [i.to_bytes(16, "big") for i in range(32)]
    pub = KVEventPublisher("inproc://kv-events-cost")
    try:
        for name, sink in (("off", NULL_SINK), ("on", pub)):
            stored = median_us(lambda i, s=sink: s.stored(Medium.HOST, (keys[i % 32],)))
            described = median_us(lambda i, s=sink: s.describe(keys, tokens, space))
            print(f"events {name}: stored(1 chunk) {stored:.2f} us, describe(8192 tokens) {described:.1f} us (median)")
    finally:
        pub.close()


if __name__ == "__main__":
    main()
