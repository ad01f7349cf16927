"""``kvdepot bench tp``: MLA under tensor parallel 2 in server mode, one copy per chunk vs a copy per rank.

Two ranks (threads here, each with its own server session, as rank processes have) register pools
of an MLA geometry (default DeepSeek-V2-Lite's: 27 layers, one latent row of 512 + 64, bf16,
``kv_factor`` 1) with one ``kvdepot server``, once per mode, each mode its own model group:
``tp_kv_copies: one`` (one copy per chunk, loaded into both pools) and ``per-rank``. Both ranks
store the same chunks, as both ranks' workers do; then rank 0 looks them up (LOOKUP leases them) and
both ranks load them into their own pools at once. Load time: wall time until both ranks' loads
are in (CUDA: synchronized). Bytes stored per chunk: the server's ``bytes_stored`` over the chunks.
Every store is checked (all chunks stored, once or per rank) and every load byte for byte. The
modes alternate repetition by repetition, beside the ceiling: a plain copy of the same bytes into
the same pools, timed in the same run. The server's host budget is sized so that each group's
share holds its chunks, whichever registers first (docs/server.md, budget shares).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.bench.server_proc import arena_allocated, running_server
from kvdepot.config import load_config
from kvdepot.engine_api import Lease
from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import shared_cpu_pool
from kvdepot.server.remote import RemoteEngine

MODES = ("one", "per-rank")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="where the ranks' pools live: cpu (shared files) or cuda (IPC)")
    parser.add_argument("--layers", type=int, default=27, help="layers (DeepSeek-V2-Lite: 27)")
    parser.add_argument("--latent", type=int, default=576, help="latent row per token: kv_lora_rank + rope dims (512 + 64)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"), help="KV dtype")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="tokens per pool block (TensorRT-LLM default: 32)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (the server's)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks stored and loaded per repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per mode (after one warm-up)")
    add_output_arguments(parser)


class _Rank:
    """One rank's pool (stored blocks, then as many blocks to load into) and its server registration."""

    def __init__(self, url: str, rank: int, model_id: str, copies: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, tokens_per_block: int, workdir: Path) -> None:
        if device.type == "cuda":
            self.pool = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.pool = shared_cpu_pool(str(workdir / f"{model_id}-{rank}"), shape, dtype)
        self.client = DepotClient(url, timeout_s=120.0, name=f"bench-tp-rank{rank}")
        config = load_config(tp_kv_copies=copies)
        self.engine = RemoteEngine(self.client, self.pool, tokens_per_block, model_id=model_id, tp_rank=rank,
                                   tp_size=2, config=config)

    def close(self) -> None:
        self.engine.close()
        self.client.close()


def _both(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run the ranks' calls at once (as rank processes would) and return their results."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        out[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    tpb, bpc = args.tokens_per_block, args.chunk_size // args.tokens_per_block
    n_blocks = args.chunks * bpc
    shape = (2 * n_blocks, args.layers, 1, tpb * args.latent)  # stored blocks, then the blocks loads fill
    chunk_bytes = bpc * args.layers * tpb * args.latent * dtype.itemsize
    # The server's budget is shared a group at a time: the one-copy group's shard a half, each
    # per-rank shard a quarter. A quarter must hold the chunks, with room for shares met to
    # within a segment (1/16 of the budget): 6x the chunks in all.
    capacity_gb = 6 * args.chunks * chunk_bytes / 1e9 + 0.01
    report = Report(args, steps=2 * (args.reps + 1) + 2, device=device, name="bench tp",
                    bars=Bars(("mode",), ("load ms", "memcpy ms"), "ms"))
    source = torch.randn(n_blocks, args.layers, 1, tpb * args.latent).to(dtype)
    with running_server("--chunk-size", str(args.chunk_size), "--host-capacity-gb", f"{capacity_gb:.3f}") as url, \
            tempfile.TemporaryDirectory(prefix="kvd-bench-tp-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        ranks = {m: [_Rank(url, r, f"bench-tp-mla-{m}", m, shape, dtype, device, tpb, Path(tmp)) for r in range(2)]
                 for m in MODES}
        try:
            return _measure(args, report, ranks, source, device, chunk_bytes, n_blocks)
        finally:
            for pair in ranks.values():
                for rank in pair:
                    rank.close()


def _measure(args: argparse.Namespace, report: Report, ranks: dict[str, list[_Rank]], source: torch.Tensor,
             device: torch.device, chunk_bytes: int, n_blocks: int) -> list[dict]:
    deadline = time.monotonic() + 60
    while not all(r.engine.ready for pair in ranks.values() for r in pair):
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks did not register with the server")
        time.sleep(0.01)
    # Stores before a shard's share of the server's arena is pinned are dropped (seconds on CUDA
    # hosts): wait until every shard of both groups has pinned its share (at most 30 s; a store
    # that still finds no room is caught below).
    pinned_by = time.monotonic() + 30
    while time.monotonic() < pinned_by and not arena_allocated(ranks["per-rank"][0].engine.stats()):
        time.sleep(0.05)
    stored_ids, load_ids = list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))
    tokens = list(range(1, args.chunks * args.chunk_size + 1))
    stored: dict[str, float] = {}
    for mode, pair in ranks.items():
        with report.step(f"store {mode}"):
            keys = pair[0].engine.chunk_keys(tokens)
            for rank in pair:
                rank.pool[:n_blocks].copy_(source.to(device))  # the latent: the same on every rank
            _sync(device)
            _both([lambda r=r, k=keys: r.engine.store(k, stored_ids).wait() for r in pair])
            shards = [s for s in pair[0].engine.stats().shards if s.group == pair[0].engine.granted.group]
            stored[mode] = sum(s.figures.get("bytes_stored", 0.0) for s in shards)
            expected = args.chunks * chunk_bytes * (1 if mode == "one" else len(pair))
            if stored[mode] != expected:
                dropped = sum(s.figures.get("dropped_stores", 0.0) for s in shards)
                raise RuntimeError(f"{mode}: the server stored {stored[mode]:.0f} of {expected} bytes "
                                   f"({dropped:.0f} chunks dropped; see its log)")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    ceiling: list[float] = []
    for rep in range(args.reps + 1):
        for mode, pair in ranks.items():
            with report.step(f"load {mode}"):
                seconds = _load_once(pair, tokens, load_ids, n_blocks, device, rep)
            if rep:
                times[mode].append(seconds)
        pools = [r.pool for r in ranks["one"]]
        _sync(device)
        start = time.perf_counter()
        _both([lambda pool=pool: pool[n_blocks:].copy_(pool[:n_blocks]) for pool in pools])  # as the ranks load
        _sync(device)
        if rep:
            ceiling.append(time.perf_counter() - start)
    memcpy_ms = statistics.median(ceiling) * 1e3
    total = 2 * n_blocks * ranks["one"][0].engine.layout.bytes_per_block  # bytes landing in the two pools
    per_rank_stored = stored["per-rank"] / args.chunks
    report.table(f"MLA under TP 2, server mode ({device.type}): {args.chunks} chunks of {args.chunk_size} tokens, "
                 f"{chunk_bytes / 2**20:.2f} MiB per chunk per rank; median of {args.reps}", mode=8)
    rows = []
    for mode in MODES:
        load_ms = statistics.median(times[mode]) * 1e3
        rows.append(report.add({
            "mode": mode, "copies per chunk": round(stored[mode] / args.chunks / chunk_bytes, 2),
            "bytes stored per chunk": int(stored[mode] / args.chunks),
            "vs per-rank": f"{stored[mode] / args.chunks / per_rank_stored:.2f}",
            "load ms (both ranks)": f"{load_ms:.2f}", "GB/s into pools": f"{total / load_ms / 1e6:.2f}",
            "memcpy ms": f"{memcpy_ms:.2f}", "load / memcpy": f"{load_ms / memcpy_ms:.2f}",
        }))
    report.finish()
    return rows


def _load_once(pair: list[_Rank], tokens: list[int], load_ids: list[int], n_blocks: int, device: torch.device,
               rep: int) -> float:
    """Rank 0 looks the chunks up (leasing them), both ranks load them; checked byte for byte."""
    for rank in pair:
        rank.pool[n_blocks:].zero_()
    _sync(device)
    scheduler = pair[0].engine
    keys = scheduler.chunk_keys(tokens)
    rid = 1000 + rep
    hit = scheduler.probe(keys, lease=Lease(rid))
    if hit.tokens != len(tokens):
        raise RuntimeError(f"lookup found {hit.tokens} of {len(tokens)} tokens: the server lost stored chunks")
    lease = scheduler.handover(rid)
    start = time.perf_counter()
    ends = _both([lambda r=r: r.engine.retrieve(keys, load_ids, lease=lease) for r in pair])
    _sync(device)
    seconds = time.perf_counter() - start
    scheduler.release(Lease(rid))
    for rank, end in zip(pair, ends, strict=True):
        if end != len(tokens) or not torch.equal(rank.pool[n_blocks:].view(torch.uint8), rank.pool[:n_blocks].view(torch.uint8)):
            raise RuntimeError(f"rank {rank.engine.tp_rank}: the load ({end} tokens) is not the stored bytes")
    return seconds
