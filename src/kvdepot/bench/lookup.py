"""``kvdepot bench lookup``: time to key and look up a long prompt on the CPU.

Measures the two parts a scheduler pays per request: hashing the prompt into chained chunk
keys (from a Python list, as TensorRT-LLM's ``get_tokens`` returns, and from a numpy array),
and the host-tier lookup of every chunk (all hits: the worst case, it walks the whole prompt).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from kvdepot.bench.common import median_seconds
from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.config import load_config
from kvdepot.engine import CacheEngine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=128 * 1024, help="prompt length to key and look up")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per kvdepot chunk")
    parser.add_argument("--reps", type=int, default=50, help="timed calls of each kind (the median is shown)")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    algos = ("xxh3_128", "blake3")
    report = Report(args, steps=len(algos), bars=Bars(("hash",), ("keys from list ms", "keys from numpy ms",
                                                                  "lookup (all hit) ms"), "ms"), name="bench lookup")
    report.table(f"kvdepot bench lookup — {args.tokens} tokens, chunk {args.chunk_size}, median of {args.reps} "
                 "(CPU work: the same on a GPU server's host)")
    for algo in algos:
        with report.step(algo):
            report.add(_measure(args, algo))
    return report.finish()


def _measure(args: argparse.Namespace, algo: str) -> dict:
    cpu = torch.device("cpu")
    chunks = args.tokens // args.chunk_size
    # A tiny pool geometry (one small block per chunk) so every chunk of the prompt fits in memory.
    pool = torch.zeros((chunks + 1, 1, 1, args.chunk_size), dtype=torch.uint8)
    config = load_config(chunk_size=args.chunk_size, host_capacity_gb=(chunks + 1) * args.chunk_size / 1e9, hash_algo=algo)
    engine = CacheEngine.for_pool(pool, args.chunk_size, config)
    tokens_np = np.random.default_rng(0).integers(0, 128_000, size=args.tokens, dtype=np.int64)
    tokens = tokens_np.tolist()
    keys = engine.chunk_keys(tokens)
    engine.store(keys, list(range(chunks)))
    key_list = median_seconds(lambda: engine.chunk_keys(tokens), cpu, args.reps)
    key_np = median_seconds(lambda: engine.chunk_keys(tokens_np), cpu, args.reps)
    look = median_seconds(lambda: engine.lookup(keys), cpu, args.reps)
    assert engine.lookup(keys) == chunks * args.chunk_size
    return {
        "hash": algo,
        "tokens": args.tokens,
        "chunks": chunks,
        "keys from list ms": key_list * 1e3,
        "keys from numpy ms": key_np * 1e3,
        "lookup (all hit) ms": look * 1e3,
        "total (list) ms": (key_list + look) * 1e3,
        "total (numpy) ms": (key_np + look) * 1e3,
    }
