"""Host-side bookkeeping of ``CacheEngine`` store / lookup / retrieve, without any copy.

The engine runs on a CPU pool shaped like TensorRT-LLM's cross-layer pool, with a mover that
does nothing, so what is timed is only the Python around the copy: keys, block-id checks, slot
booking (evicting LRU chunks: the arena holds 3 operations and is filled first), pins and
commits. Keys and block ids are drawn before the clock, as ``kvdepot bench transfer`` does.
Prints the median microseconds per call; ``--profile`` adds cProfile's top functions.

    python tools/engine_bookkeeping.py [--tokens 8192] [--reps 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.layout import PoolLayout


class NullMover:
    """A mover that copies nothing: the engine's bookkeeping is all that is left to time."""

    def gather(self, views, block_ids, dst, first=0):
        pass

    def scatter(self, src, views, block_ids, first=0):
        pass

    def gather_many(self, views, copies):
        pass

    def scatter_many(self, copies, views):
        pass


def build(args: argparse.Namespace) -> tuple[CacheEngine, Callable[[], tuple[list, list[int]]]]:
    """An engine over an (untouched, so unbacked) pool of 3 operations' blocks, and a batch maker."""
    moved = args.tokens // args.tokens_per_block
    elems = args.kv_heads * args.tokens_per_block * args.head_dim
    pool = torch.empty((moved * 3, args.layers, 2, elems), dtype=torch.bfloat16)
    op_bytes = moved * pool[0].numel() * pool.element_size()
    config = load_config(chunk_size=args.chunk_size, host_capacity_gb=(3 * op_bytes + 1) / 1e9, pin_host_memory="false")
    layout = PoolLayout.from_pool(pool, args.tokens_per_block, args.chunk_size)
    engine = CacheEngine(layout, config, mover=NullMover())
    engine.register_pool(pool)
    rng = random.Random(0)
    counter = iter(range(1 << 40))

    def batch() -> tuple[list, list[int]]:
        tokens = [next(counter) % 100_000 for _ in range(args.tokens)]
        return engine.chunk_keys(tokens), rng.sample(range(pool.shape[0]), moved)

    return engine, batch


def measure(args: argparse.Namespace, profiler: cProfile.Profile | None = None) -> dict[str, list[float]]:
    engine, batch = build(args)
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
        engine.lookup(held)  # as the bench does; also keeps ``held`` recently used
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens-per-block", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per operation")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions as well")
    args = ap.parse_args()
    profiler = cProfile.Profile() if args.profile else None
    times = measure(args, profiler)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    blocks = args.tokens // args.tokens_per_block
    print(f"{args.tokens} tokens = {args.tokens // args.chunk_size} chunks = {blocks} blocks per op, {args.reps} reps")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"{name:13s} median {statistics.median(values):8.1f} us   p10 {q[0]:8.1f}   p90 {q[-1]:8.1f}")


if __name__ == "__main__":
    main()
