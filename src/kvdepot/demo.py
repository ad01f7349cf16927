"""``kvdepot demo``: the README's main job. A long prompt served twice by the reference runtime
with kvdepot connected, through an engine pool too small to keep it between the two runs.

    0. a short warm-up prompt: kernels, allocator and kvdepot's threads start here, untimed
    1. prompt A (miss): computed, saved to kvdepot
    2. prompt B: evicts A from the engine's own pool
    3. prompt A again (hit): its KV is loaded from kvdepot, not recomputed

It prints TTFT of the miss and the hit, the tokens served from the cache (and why the last few
are computed anyway), and whether the hit's greedy output equals the miss's. CPU by default (a
small model, seconds); CUDA when present. Without the warm-up the miss was the process's first
forward and the speed-up moved from 8x to 63x over six runs on the dev VM.

torch and the runtime are imported by ``run`` only: ``add_arguments`` is part of ``kvdepot --help``.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time

from kvdepot.errors import KVDepotError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--model", default=None, help="runtime preset (small, llama-1b, llama-8b) or a checkpoint dir; "
                        "default: small on CPU, llama-1b on CUDA")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length, at least one chunk (config chunk_size); default: 2048 on CPU, 8192 on CUDA")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens generated per run (compared miss vs hit)")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="tokens per block of the engine's KV pool")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")


def _progress(step: int, total: int, text: str) -> None:
    print(f"[{step}/{total}] {text}", flush=True)


def expected_hit(prompt_tokens: int, chunk_size: int, tokens_per_block: int) -> int:
    """Tokens a hit can serve: whole chunks only, and never the block holding the prompt's last
    token — the engine recomputes that block, because it needs the last token's logits."""
    return min(prompt_tokens // chunk_size * chunk_size, (prompt_tokens - 1) // tokens_per_block * tokens_per_block)


def explain_recompute(prompt_tokens: int, served: int, chunk_size: int, tokens_per_block: int) -> str:
    """One sentence saying why ``prompt_tokens - served`` tokens of a hit were computed."""
    computed = prompt_tokens - served
    if computed <= 0:
        return ""
    reasons = [f"the last block ({tokens_per_block} tokens, holding the prompt's last token) is always computed: "
               "the engine needs that token's logits for the first new token"]
    tail = prompt_tokens % chunk_size
    if tail:
        reasons.append(f"the {tail} tokens past the last whole {chunk_size}-token chunk are never cached")
    return f"{computed} tokens computed on the hit: " + "; and ".join(reasons)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvdepot.config import load_config
    from kvdepot.integrations.tensorrt_llm.adapter import (
        KvDepotConnectorScheduler,
        KvDepotConnectorWorker,
    )
    from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine
    from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model or ("llama-1b" if device.type == "cuda" else "small")
    prompt_tokens = args.prompt_tokens or (8192 if device.type == "cuda" else 2048)
    tpb, chunk = args.tokens_per_block, load_config().chunk_size
    if prompt_tokens < chunk:
        raise KVDepotError(f"demo: --prompt-tokens {prompt_tokens} is shorter than one chunk (chunk_size {chunk}): "
                           f"kvdepot caches whole chunks, so nothing could be served; use --prompt-tokens >= {chunk} "
                           "or a smaller KVDEPOT_CHUNK_SIZE")
    # The pool holds exactly one request (prompt + new tokens): running B must evict all of A.
    max_tokens = -(-(prompt_tokens + args.new_tokens) // tpb) * tpb
    llm_args = TorchLlmArgs(model=model, kv_cache_config=KvCacheConfig(tokens_per_block=tpb, max_tokens=max_tokens))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    destroy_engine()
    _progress(1, 5, f"building the runtime: model={model} device={device} pool={max_tokens} tokens")
    engine = Engine(model, device=device, llm_args=llm_args,
                    connector=(KvDepotConnectorScheduler, KvDepotConnectorWorker), seed=args.seed)
    vocab = engine.model.config.vocab_size
    rng = random.Random(args.seed)
    prompt_a = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    prompt_b = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    warm = [rng.randrange(vocab) for _ in range(min(prompt_tokens, 4 * tpb))]
    started = time.perf_counter()
    _progress(2, 5, f"warm-up ({len(warm)} tokens, untimed): the process's first forward pays one-time costs ...")
    engine.generate([warm], 1)
    depot = current_engine()
    if depot is not None:
        depot.wait_all()
    _progress(3, 5, f"prompt A ({prompt_tokens} tokens): computing and saving to kvdepot ...")
    miss = engine.generate([prompt_a], args.new_tokens)[0]
    _progress(4, 5, "prompt B: evicting A from the engine's pool ...")
    engine.generate([prompt_b], args.new_tokens)
    _progress(5, 5, "prompt A again: loading its KV from kvdepot ...")
    hit = engine.generate([prompt_a], args.new_tokens)[0]
    depot = current_engine()
    stats = depot.stats() if depot else None
    identical = miss.output_ids == hit.output_ids
    served = hit.num_connector_matched_tokens
    print()
    print(f"kvdepot demo — {model} on {device}, prompt {prompt_tokens} tokens, {args.new_tokens} new tokens, "
          f"chunk {chunk}, block {tpb}")
    print(f"  TTFT miss (computed):        {miss.ttft_s * 1e3:9.1f} ms")
    speedup = f"{miss.ttft_s / hit.ttft_s:.1f}x faster" if served else "not a kvdepot hit"
    print(f"  TTFT hit  (kvdepot):         {hit.ttft_s * 1e3:9.1f} ms   ({speedup})")
    print(f"  tokens on device (engine):   {hit.num_device_reused_tokens:6d}")
    print(f"  tokens from kvdepot:         {served:6d} of {prompt_tokens}")
    if note := explain_recompute(prompt_tokens, served, chunk, tpb):
        print(f"    ({note})")
    print(f"  outputs identical:           {identical}")
    if stats is not None:
        print(f"  kvdepot: {stats.stored_chunks} chunks stored ({stats.bytes_stored / 1e6:.1f} MB), "
              f"{stats.loaded_chunks} loaded ({stats.bytes_loaded / 1e6:.1f} MB), leases live: {stats.live_leases}")
    print(f"  total time: {time.perf_counter() - started:.1f} s")
    destroy_engine()
    ok = identical and served > 0 and hit.num_device_reused_tokens == 0
    if not ok:
        print(f"demo FAILED: the hit was not served by kvdepot (expected {expected_hit(prompt_tokens, chunk, tpb)} "
              f"tokens, got {served}) or its output differs", file=sys.stderr)
    return 0 if ok else 1
