"""``kvdepot demo``: the README's main job. A long prompt served twice by the reference runtime
with kvdepot connected, through an engine pool too small to keep it between the two runs.

    1. prompt A (miss): computed, saved to kvdepot
    2. prompt B: evicts A from the engine's own pool
    3. prompt A again (hit): its KV is loaded from kvdepot, not recomputed

It prints TTFT of the miss and the hit, the tokens served from the cache, and whether the
hit's greedy output equals the miss's. CPU by default (a small model, seconds); CUDA when present.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time

import torch

from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
)
from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--model", default=None, help="runtime preset (small, llama-1b, llama-8b) or a checkpoint dir; "
                        "default: small on CPU, llama-1b on CUDA")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default: 2048 on CPU, 8192 on CUDA")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)


def _progress(step: int, total: int, text: str) -> None:
    print(f"[{step}/{total}] {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

    device = torch.device(args.device)
    model = args.model or ("llama-1b" if device.type == "cuda" else "small")
    prompt_tokens = args.prompt_tokens or (8192 if device.type == "cuda" else 2048)
    tpb = args.tokens_per_block
    # The pool holds exactly one request (prompt + new tokens): running B must evict all of A.
    max_tokens = -(-(prompt_tokens + args.new_tokens) // tpb) * tpb
    llm_args = TorchLlmArgs(model=model, kv_cache_config=KvCacheConfig(tokens_per_block=tpb, max_tokens=max_tokens))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    destroy_engine()
    _progress(1, 4, f"building the runtime: model={model} device={device} pool={max_tokens} tokens")
    engine = Engine(model, device=device, llm_args=llm_args,
                    connector=(KvDepotConnectorScheduler, KvDepotConnectorWorker), seed=args.seed)
    vocab = engine.model.config.vocab_size
    rng = random.Random(args.seed)
    prompt_a = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    prompt_b = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    started = time.perf_counter()
    _progress(2, 4, f"prompt A ({prompt_tokens} tokens): computing and saving to kvdepot ...")
    miss = engine.generate([prompt_a], args.new_tokens)[0]
    _progress(3, 4, "prompt B: evicting A from the engine's pool ...")
    engine.generate([prompt_b], args.new_tokens)
    _progress(4, 4, "prompt A again: loading its KV from kvdepot ...")
    hit = engine.generate([prompt_a], args.new_tokens)[0]
    depot = current_engine()
    stats = depot.stats() if depot else None
    identical = miss.output_ids == hit.output_ids
    print()
    print(f"kvdepot demo — {model} on {device}, prompt {prompt_tokens} tokens, {args.new_tokens} new tokens")
    print(f"  TTFT miss (computed):        {miss.ttft_s * 1e3:9.1f} ms")
    print(f"  TTFT hit  (kvdepot):         {hit.ttft_s * 1e3:9.1f} ms   ({miss.ttft_s / hit.ttft_s:.1f}x faster)")
    print(f"  tokens on device (engine):   {hit.num_device_reused_tokens:6d}")
    print(f"  tokens from kvdepot:         {hit.num_connector_matched_tokens:6d} of {prompt_tokens}")
    print(f"  outputs identical:           {identical}")
    if stats is not None:
        print(f"  kvdepot: {stats.stored_chunks} chunks stored ({stats.bytes_stored / 1e6:.1f} MB), "
              f"{stats.loaded_chunks} loaded ({stats.bytes_loaded / 1e6:.1f} MB), leases live: {stats.live_leases}")
    print(f"  total time: {time.perf_counter() - started:.1f} s")
    destroy_engine()
    ok = identical and hit.num_connector_matched_tokens > 0 and hit.num_device_reused_tokens == 0
    if not ok:
        print("demo FAILED: the hit was not served by kvdepot or its output differs", file=sys.stderr)
    return 0 if ok else 1
