"""``kvdepot bench transfer``: CacheEngine store/retrieve GB/s against plain memcpy, same run.

Pool: Llama-3-8B-shaped by default (32 layers, 8 KV heads, head_dim 128, 32 tokens per block,
bf16 — 4 MiB blocks) in TensorRT-LLM's layout. Blocks are picked in random order, so no two
are adjacent: the path is measured the way a real prefix lands in a fragmented pool.
"""

from __future__ import annotations

import argparse
import random

import torch

from kvdepot.bench.common import device_name, median_seconds, memcpy_ceiling, print_table, sync
from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.transfer import MOVERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=None, help="blocks moved per operation (default: 256 on CUDA, 32 on CPU)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mover", choices=sorted(MOVERS) + ["all"], default="all", help="transfer path(s) to measure")


def run(args: argparse.Namespace) -> list[dict]:
    names = sorted(MOVERS) if args.mover == "all" else [args.mover]
    rows = [row for name in names for row in _run_one(args, name)]
    print_table(f"kvdepot bench transfer — {device_name(torch.device(args.device))}", rows)
    return rows


def _run_one(args: argparse.Namespace, mover: str) -> list[dict]:
    device = torch.device(args.device)
    moved = args.blocks or (256 if device.type == "cuda" else 32)
    elems = args.kv_heads * args.tokens_per_block * args.head_dim
    pool = torch.empty((moved * 2, args.layers, 2, elems), dtype=torch.bfloat16, device=device)
    pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
    block_bytes = pool[0].numel() * pool.element_size()
    nbytes = moved * block_bytes
    chunk_blocks = args.chunk_size // args.tokens_per_block
    moved -= moved % chunk_blocks
    reps = args.reps
    config = load_config(chunk_size=args.chunk_size, host_capacity_gb=nbytes * (reps + 3) / 1e9)
    engine = CacheEngine.for_pool(pool, args.tokens_per_block, config)
    engine.mover = MOVERS[mover]()
    rng = random.Random(0)
    counter = iter(range(1 << 30))

    def fresh():
        tokens = [next(counter) % 100_000 for _ in range(moved * args.tokens_per_block)]
        return engine.chunk_keys(tokens), rng.sample(range(pool.shape[0]), moved)

    jobs = [fresh() for _ in range(reps + 1)]

    def store():
        keys, ids = jobs.pop()
        engine.store(None, ids, keys=keys).wait()

    store_s = median_seconds(store, device, reps)
    stored = [k for k in engine.host._ready]  # noqa: SLF001 - bench reads what it just stored
    keys_sets = [stored[i : i + moved // chunk_blocks] for i in range(0, len(stored) - moved // chunk_blocks + 1, moved // chunk_blocks)]

    def retrieve():
        keys = keys_sets[rng.randrange(len(keys_sets))]
        ids = rng.sample(range(pool.shape[0]), moved)
        engine.retrieve(None, ids, keys=keys)
        sync(device)

    load_s = median_seconds(retrieve, device, reps)
    engine.wait_all()
    h2d, d2h = memcpy_ceiling(nbytes, device, reps)
    shape = f"L{args.layers} H{args.kv_heads} D{args.head_dim} tpb{args.tokens_per_block}"
    common = {"mover": mover, "shape": shape, "block MiB": block_bytes / 2**20, "blocks": moved, "pinned": engine.host.pin_memory}
    return [
        {**common, "op": "store", "GB/s": nbytes / store_s / 1e9, "memcpy GB/s": d2h, "ratio": nbytes / store_s / 1e9 / d2h},
        {**common, "op": "retrieve", "GB/s": nbytes / load_s / 1e9, "memcpy GB/s": h2d, "ratio": nbytes / load_s / 1e9 / h2d},
    ]
