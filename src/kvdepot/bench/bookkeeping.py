"""``kvdepot bench bookkeeping``: the host-side cost of ``CacheEngine`` store / lookup / retrieve,
without any copy (CPU).

The engine runs on a CPU pool shaped like TensorRT-LLM's cross-layer pool (never touched, so never
backed by memory), with a mover that copies nothing: what is timed is only the Python around the
copy — keys, block-id checks, slot booking (evicting LRU chunks: the arena holds three operations
and is filled first), pins and commits. Keys and block ids are drawn before the clock, as ``bench
transfer`` does. This is the floor under every transfer's latency, whatever the device; on the
H200's host it predicted a 32-chunk store's bookkeeping within 10% (docs/perf-notes.md).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvdepot.bench.report import Bars, Report, add_output_arguments


class NullMover:
    """A mover that copies nothing: the engine's bookkeeping is all that is left to time."""

    def gather(self, views: Sequence[Any], block_ids: Sequence[int], dst: Any, first: int = 0) -> None:
        pass

    def scatter(self, src: Any, views: Sequence[Any], block_ids: Sequence[int], first: int = 0) -> None:
        pass

    def gather_many(self, views: Sequence[Any], copies: Sequence[Any]) -> None:
        pass

    def scatter_many(self, copies: Sequence[Any], views: Sequence[Any]) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=16, help="layers of the pool (Llama-3.2-1B: 16)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    parser.add_argument("--head-dim", type=int, default=64, help="elements per head")
    parser.add_argument("--tokens-per-block", type=int, default=8, help="tokens per pool block (small blocks: most bookkeeping)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per kvdepot chunk")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per operation")
    parser.add_argument("--reps", type=int, default=200, help="timed operations of each kind")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top 25 functions")
    add_output_arguments(parser)


def _build(args: argparse.Namespace) -> tuple[Any, Callable[[], tuple[list, list[int]]]]:
    """An engine over an untouched pool of three operations' blocks, and a batch maker."""
    import torch

    from kvdepot.config import load_config
    from kvdepot.engine import CacheEngine
    from kvdepot.layout import PoolLayout

    moved = args.tokens // args.tokens_per_block
    elems = args.kv_heads * args.tokens_per_block * args.head_dim
    pool = torch.empty((moved * 3, args.layers, 2, elems), dtype=torch.bfloat16)
    op_bytes = moved * pool[0].numel() * pool.element_size()
    config = load_config(chunk_size=args.chunk_size, host_capacity_gb=(3 * op_bytes + 1) / 1e9, pin_host_memory="false")
    layout = PoolLayout.from_pool(pool, args.tokens_per_block, args.chunk_size)
    engine = CacheEngine(layout, config, mover=NullMover())
    engine.register_pool(pool)
    rng, counter = random.Random(0), iter(range(1 << 40))

    def batch() -> tuple[list, list[int]]:
        tokens = [next(counter) % 100_000 for _ in range(args.tokens)]
        return engine.chunk_keys(tokens), rng.sample(range(pool.shape[0]), moved)

    return engine, batch


def measure(args: argparse.Namespace, profiler: cProfile.Profile | None = None) -> dict[str, list[float]]:
    """Microseconds per call of each kind, one sample per repetition."""
    engine, batch = _build(args)
    chunks = args.tokens // args.chunk_size
    batches = [batch() for _ in range(4 + args.reps)]
    times: dict[str, list[float]] = {"store": [], "lookup": [], "lookup+lease": [], "retrieve": []}

    def store(keys: list, ids: list[int]) -> None:
        if engine.store(keys, ids).chunks != chunks:  # a dropped store would time as free
            raise RuntimeError("store placed fewer chunks than asked: the arena did not evict")

    for keys, ids in batches[:4]:  # fill the arena once over: every timed store evicts
        store(keys, ids)
    held, held_ids = batches[3]
    if profiler:
        profiler.enable()
    for n, (keys, ids) in enumerate(batches[4:]):
        t0 = time.perf_counter()
        store(keys, ids)
        t1 = time.perf_counter()
        engine.lookup(held)  # as bench transfer does; also keeps ``held`` recently used
        t2 = time.perf_counter()
        engine.lookup(held, lease=n)  # as the adapters do: pin until the load
        t3 = time.perf_counter()
        got = engine.retrieve(held, held_ids, num_blocks=len(held_ids), lease=n)
        t4 = time.perf_counter()
        if got != args.tokens:
            raise RuntimeError(f"retrieve loaded {got} of {args.tokens} tokens")
        for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[name].append(t * 1e6)
    if profiler:
        profiler.disable()
    stats = engine.stats()
    if stats.live_leases or stats.pinned_chunks or stats.inflight_transfers:
        raise RuntimeError(f"leftover leases/pins/transfers: {stats}")
    engine.close()
    return times


def run(args: argparse.Namespace) -> list[dict]:
    report = Report(args, steps=1, name="bench bookkeeping", bars=Bars(("call",), ("median us", "p90 us"), "us per call"))
    blocks, chunks = args.tokens // args.tokens_per_block, args.tokens // args.chunk_size
    report.table(f"kvdepot bench bookkeeping — host time per call, no copies: {args.tokens} tokens = {chunks} chunks = "
                 f"{blocks} blocks per op (L{args.layers} H{args.kv_heads} D{args.head_dim} tpb{args.tokens_per_block}), "
                 f"{args.reps} reps", call=12)
    profiler = cProfile.Profile() if args.profile else None
    with report.step("store / lookup / retrieve"):
        times = measure(args, profiler)
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        report.add({"call": name, "median us": statistics.median(values), "p10 us": q[0], "p90 us": q[-1],
                    "us per chunk": statistics.median(values) / chunks})
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return report.finish()
