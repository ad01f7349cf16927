"""``kvdepot bench transfer``: CacheEngine store/retrieve GB/s against plain memcpy, same run.

Pool: Llama-3-8B-shaped by default (32 layers, 8 KV heads, head_dim 128, 32 tokens per block,
bf16 — 4 MiB blocks) in TensorRT-LLM's layout. Blocks are picked in random order, so no two
are adjacent: the path is measured the way a real prefix lands in a fragmented pool.

``--store-head-mib`` and ``--lanes`` take lists: the batch mover is then measured once per
combination, one after the other in the same process (config ``store_head_mib``: 0 = the store
issuer enqueues all of a store, as before issue 19; ``transfer_lanes``: 2 = windows alternate
over two streams), each row paired with its own plain copies.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvdepot.bench import call_anatomy
from kvdepot.bench.common import (
    HostSteal,
    Memcpy,
    behind_work_seconds,
    c_helper,
    compute_share,
    device_name,
    gpu_timeline,
    host_python_us,
    paired_seconds,
    sync,
)
from kvdepot.bench.numa import placement
from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.transfer import MOVERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the engine's pool lives: cuda (default when available) or cpu (host memcpy only)")
    parser.add_argument("--layers", type=int, default=32, help="layers of the pool (Llama-3-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (Llama-3-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="elements per head (Llama-3-8B: 128)")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="tokens per pool block (TensorRT-LLM's default: 32)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per kvdepot chunk (a multiple of --tokens-per-block)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens moved per operation, the same prefix for every shape (default: 8192 on CUDA, 1024 on CPU)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks moved per operation (overrides --tokens)")
    parser.add_argument("--reps", type=int, default=9, help="timed operations of each kind, each paired with a plain copy")
    parser.add_argument("--mover", choices=sorted(MOVERS) + ["all"], default="all", help="transfer path(s) to measure")
    parser.add_argument("--store-head-mib", default=None,
                        help="batch mover: config store_head_mib values to compare, comma-separated (default: the config's)")
    parser.add_argument("--lanes", default=None,
                        help="batch mover: config transfer_lanes values to compare, comma-separated (default: the config's)")
    parser.add_argument("--behind-ms", type=_milliseconds, default=2.0,
                        help="CUDA: also time a store and a retrieve called while the GPU still runs this many ms of "
                             "work (an engine's call order: the forward, then its store), from the work's end; 0: not")
    parser.add_argument("--timeline", action="store_true",
                        help="also attribute one store and one retrieve: CPU lead-in, copy-engine busy time, gaps (CUDA)")
    parser.add_argument("--anatomy", action="store_true",
                        help="batch mover, CUDA: also take --reps stores and retrieves apart by timing events (GPU lead, copy "
                             "span, tail, driver calls, simulated engine idle) beside a memcpy of the same bytes")
    add_output_arguments(parser)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _milliseconds(value: str) -> float:
    """``--behind-ms``: a number of milliseconds, 0 or more (0 leaves the rows out)."""
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not ms >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of milliseconds >= 0")
    return ms


STEPS_CUDA, STEPS_CPU = 9, 4  # measurements per mover (the bar's steps; CUDA: 2 fewer with --behind-ms 0)


def _variants(args: argparse.Namespace, mover: str) -> list[dict[str, float]]:
    """Config overrides to measure ``mover`` with: every combination of the listed values for
    the batch mover (its store head and lanes), none for the others (they use neither)."""
    if mover != "batch":
        return [{}]
    heads = [float(v) for v in args.store_head_mib.split(",")] if getattr(args, "store_head_mib", None) else [None]
    lanes = [int(v) for v in args.lanes.split(",")] if getattr(args, "lanes", None) else [None]
    return [{k: v for k, v in (("store_head_mib", h), ("transfer_lanes", n)) if v is not None} for h in heads for n in lanes]


def _label(mover: str, variant: dict[str, float]) -> str:
    parts = [f"head {variant['store_head_mib']:g}" if "store_head_mib" in variant else "",
             f"lanes {variant['transfer_lanes']}" if "transfer_lanes" in variant else ""]
    return " ".join([mover, *(p for p in parts if p)])


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    names = sorted(MOVERS) if args.mover == "all" else [args.mover]
    runs = [(name, variant) for name in names for variant in _variants(args, name)]
    report = Report(args, steps=len(runs) * (STEPS_CUDA if device.type == "cuda" else STEPS_CPU), device=device,
                    bars=Bars(("mover", "op"), ("GB/s", "memcpy GB/s"), "GB/s"), name="bench transfer")
    if device.type != "cuda":
        report.note("(CPU: the both-directions rows and the compute-share row need two copy engines and SMs; not measured)")
    report.table(f"kvdepot bench transfer — {device_name(device)}; host Python {host_python_us():.0f} us per reference loop; "
                 f"copy lists by {c_helper()}",
                 mover=22, op=29)
    parts = [(_label(name, variant), _run_one(args, name, report, variant)) for name, variant in runs]
    for key, title in (("timeline", "timeline of one call (ms; --timeline)"),
                       ("anatomy", f"anatomy of a call (us, medians of {args.reps}; --anatomy)")):
        if any(p[key] for _, p in parts):
            report.table(title, op=10)
            for name, p in parts:
                for op, row in p[key].items():
                    report.add({"mover": name, "op": op, **row})
    return report.finish()


def _run_one(args: argparse.Namespace, mover: str, report: Report,
             variant: dict[str, float] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Measure one mover (with ``variant``'s config overrides), adding each row to ``report`` as
    soon as it is measured; returns the ``--timeline`` and ``--anatomy`` attributions by op under
    those keys (empty without them)."""
    variant = variant or {}
    label = _label(mover, variant)
    device = torch.device(args.device)
    chunk_blocks = args.chunk_size // args.tokens_per_block
    tokens = getattr(args, "tokens", None) or (8192 if device.type == "cuda" else 1024)
    moved = getattr(args, "blocks", None) or max(chunk_blocks, tokens // args.tokens_per_block)
    moved -= moved % chunk_blocks
    elems = args.kv_heads * args.tokens_per_block * args.head_dim
    pool = torch.empty((moved * 3, args.layers, 2, elems), dtype=torch.bfloat16, device=device)
    pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
    block_bytes = pool[0].numel() * pool.element_size()
    nbytes = moved * block_bytes
    # Room for three batches: after the warm-up the arena is fully allocated and stores evict,
    # which is the steady state of a busy cache (first-fill pinning is not a transfer cost).
    config = load_config(chunk_size=args.chunk_size, host_capacity_gb=(3 * nbytes + 1) / 1e9, transfer_mover=mover,
                         **variant)
    engine = CacheEngine.for_pool(pool, args.tokens_per_block, config)
    engine.wait_arena()
    rng = random.Random(0)
    counter = iter(range(1 << 40))

    def fresh_keys() -> list:
        tokens = [next(counter) % 100_000 for _ in range(moved * args.tokens_per_block)]
        return engine.chunk_keys(tokens)

    def ids() -> list[int]:
        return rng.sample(range(pool.shape[0]), moved)

    # Keys and block ids are drawn before the clock starts: hashing is the scheduler's cost
    # (``bench lookup``), not the transfer's.
    anatomy = bool(getattr(args, "anatomy", False)) and device.type == "cuda" and hasattr(engine.mover, "driver")
    behind = device.type == "cuda" and getattr(args, "behind_ms", 0.0) > 0
    batches = [(fresh_keys(), ids())
               for _ in range(4 + 6 * args.reps + 16 + (args.reps if anatomy else 0) + (args.reps + 1 if behind else 0))]

    calls: list[float] = []  # seconds the caller spent in the engine's calls, per timed operation

    def store(count: int = 1) -> None:
        t0 = time.perf_counter()
        pending = [(engine.store(keys, block_ids), keys) for keys, block_ids in batches[-count:]]
        calls.append(time.perf_counter() - t0)
        del batches[-count:]
        for handle, keys in pending:
            handle.wait()
            if handle.chunks != len(keys):  # a dropped store would time as infinitely fast
                raise RuntimeError(f"store placed {handle.chunks} of {len(keys)} chunks")

    shape = f"L{args.layers} H{args.kv_heads} D{args.head_dim} tpb{args.tokens_per_block}"
    common = {"mover": label, "shape": shape, "block MiB": block_bytes / 2**20, "blocks": moved, "pinned": engine.host.pin_memory}

    def add(op: str, moved_bytes: int, op_s: float, copy_s: float, ratio: float) -> None:
        # call us: the host time of the engine's calls (what a step loop spends on them), median;
        # steal ms/s: the hypervisor's take of this VM's CPUs while the row was measured.
        call_us = statistics.median(calls) * 1e6 if calls else float("nan")
        calls.clear()
        report.add({**common, "op": op, "GB/s": moved_bytes / op_s / 1e9, "memcpy GB/s": moved_bytes / copy_s / 1e9,
                    "ratio": ratio, "call us": call_us, "steal ms/s": _nan(steal.ms_per_s())})

    with report.step(f"{label}: fill the arena"):
        for _ in range(4):  # fill the arena once over
            store()
    calls.clear()
    copies = Memcpy(nbytes, device)  # each timed operation is paired with a plain copy of its bytes
    report.note(f"NUMA {label}: {placement({'arena': engine.host.segments, 'memcpy': [copies.host]}, device)}")
    steal = HostSteal()  # read at each row, over its measurement
    with report.step(f"{label}: store"):
        store_s, d2h_s, store_ratio = paired_seconds(store, copies.d2h, device, args.reps, warmup=0)
    add("store", nbytes, store_s, d2h_s, store_ratio)
    # Two stores in flight at once (a step that stores two requests): throughput rather than the
    # latency of one, which includes the hand-off to the engine's issuer thread.
    with report.step(f"{label}: 2 stores at once"):
        two_s, two_d2h_s, two_ratio = paired_seconds(lambda: store(2), lambda: (copies.d2h(), copies.d2h()),
                                                     device, args.reps, warmup=0)
    add("2 stores at once", 2 * nbytes, two_s, two_d2h_s, two_ratio)
    # What one store costs a matmul running beside it (kernels occupy SMs; copy engines none).
    share = ceiling_share = None
    if device.type == "cuda":
        with report.step(f"{label}: compute beside a store"):
            share = compute_share(store, store_s, device, reps=5)
            # The same matmuls beside a plain copy of the same bytes: what the copy engines'
            # traffic costs compute by itself (power, memory), the ceiling of the row above.
            ceiling_share = compute_share(copies.d2h, d2h_s, device, reps=5)
    calls.clear()
    held = fresh_keys()
    engine.store(held, ids()).wait()
    steal.ms_per_s()  # the compute-share runs and this store are no row's

    def load_held(block_ids: list[int]) -> None:
        if engine.retrieve(held, block_ids) != moved * args.tokens_per_block:
            raise RuntimeError("benchmark retrieve found its chunks evicted")  # would time as infinitely fast

    def lookup() -> None:
        # A lookup precedes every load, as in an engine, whose scheduler makes it a step or more
        # before the worker loads (TensorRT-LLM's get_num_new_matched_tokens, vLLM's too): off
        # the load's clock, timed by ``bench lookup``. It also keeps ``held`` recently used.
        engine.lookup(held)

    def retrieve() -> None:
        t0 = time.perf_counter()
        load_held(batches[-1][1])
        calls.append(time.perf_counter() - t0)

    with report.step(f"{label}: retrieve"):
        load_s, h2d_s, load_ratio = paired_seconds(retrieve, copies.h2d, device, args.reps, before=lookup)
    add("retrieve", nbytes, load_s, h2d_s, load_ratio)
    with report.step(f"{label}: lookup + retrieve"):  # the row's definition before issue 19's fourth pass
        with_s, h2d2_s, with_ratio = paired_seconds(lambda: (lookup(), retrieve()), copies.h2d, device, args.reps)
    add("lookup + retrieve", nbytes, with_s, h2d2_s, with_ratio)

    def both(pairs: int = 1) -> None:
        """``pairs`` stores, then as many loads, in flight together on the engine's two streams.
        One pair is the latency of a store and a load started together; two are the throughput of
        a busy cache, where one operation's host-side start overlaps the copies of the one before.
        (Stores first: a load makes the caller's stream wait, and a later store waits for that.)"""
        taken = batches[-pairs:]
        del batches[-pairs:]
        t0 = time.perf_counter()
        handles = [engine.store(keys, block_ids) for keys, block_ids in taken]
        for _keys, block_ids in batches[-pairs:]:
            load_held(block_ids)
        calls.append(time.perf_counter() - t0)
        for handle in handles:
            handle.wait()

    if copies.both is not None:  # CUDA: two copy engines
        both_copy = copies.both
        with report.step(f"{label}: both at once"):
            both_s, bidir_s, both_ratio = paired_seconds(both, both_copy, device, args.reps, before=lookup)
        add("both at once", 2 * nbytes, both_s, bidir_s, both_ratio)
        with report.step(f"{label}: both, 2 each in flight"):
            both2_s, bidir2_s, both2_ratio = paired_seconds(lambda: both(2), lambda: (both_copy(), both_copy()),
                                                            device, args.reps, before=lookup)
        add("both, 2 each in flight", 4 * nbytes, both2_s, bidir2_s, both2_ratio)
    if behind:
        behind_ms = args.behind_ms
        # The rows above start each operation on an idle GPU, so the host's time before the first
        # copy is all on the clock; in an engine the store is called while its forward still runs.
        stream = torch.cuda.current_stream(device)
        with report.step(f"{label}: store behind work"):
            behind_s, d2h_b_s, behind_ratio = behind_work_seconds(
                store, lambda: (copies.d2h(), stream.synchronize()), device, args.reps, behind_ms / 1e3, before=lookup)
        add(f"store behind {behind_ms:g} ms of work", nbytes, behind_s, d2h_b_s, behind_ratio)
        with report.step(f"{label}: retrieve behind work"):
            behind_s, h2d_b_s, behind_ratio = behind_work_seconds(retrieve, copies.h2d, device, args.reps, behind_ms / 1e3,
                                                                  before=lookup)
        add(f"retrieve behind {behind_ms:g} ms of work", nbytes, behind_s, h2d_b_s, behind_ratio)
    if share is not None:
        # ratio here: matmul throughput beside a store over alone (1.0 = the store costs compute nothing)
        report.add({**common, "op": "compute beside store", "GB/s": float("nan"), "memcpy GB/s": float("nan"), "ratio": share,
                    "call us": float("nan"), "steal ms/s": float("nan")})
        report.add({**common, "op": "compute beside memcpy", "GB/s": float("nan"), "memcpy GB/s": float("nan"),
                    "ratio": ceiling_share, "call us": float("nan"),
                    "steal ms/s": float("nan")})
    timeline = {}
    if getattr(args, "timeline", False) and device.type == "cuda":
        timeline = {"retrieve": gpu_timeline(lambda: (lookup(), retrieve())), "store": gpu_timeline(store)}  # a store evicts
    parts = _anatomy(engine, store, lookup, retrieve, copies, device, nbytes / d2h_s / 1e9, nbytes / h2d_s / 1e9,
                     args.reps) if anatomy else {}
    calls.clear()
    engine.wait_all()
    engine.close()
    return {"timeline": timeline, "anatomy": parts}


def _anatomy(engine: CacheEngine, store: Callable[[], None], lookup: Callable[[], None], load: Callable[[], None],
             copies: Memcpy, device: torch.device, d2h_gbps: float, h2d_gbps: float, reps: int) -> dict[str, dict[str, float]]:
    """``--anatomy``: ``reps`` stores and retrieves taken apart by ``call_anatomy``, each beside a
    memcpy of its bytes; the simulated engine runs at this run's memcpy rates."""
    recorder = call_anatomy.RecordingDriver(engine.mover.driver)  # type: ignore[attr-defined]
    engine.mover.driver = recorder  # type: ignore[attr-defined]
    samples: dict[str, list[dict[str, float]]] = {"store": [], "memcpy d2h": [], "retrieve": [], "memcpy h2d": []}
    try:
        for _ in range(reps):
            # Off the clock, before each store too: the rows before leave ``held`` the coldest
            # chunks of a full arena, and a store would evict them before the retrieve below.
            lookup()
            samples["store"].append(call_anatomy.measure(store, recorder, lambda: sync(device), d2h_gbps))
            samples["memcpy d2h"].append(call_anatomy.measure(copies.d2h, None, lambda: sync(device), d2h_gbps))
            lookup()  # off the clock, as for the retrieve rows
            samples["retrieve"].append(call_anatomy.measure(load, recorder, lambda: sync(device), h2d_gbps))
            samples["memcpy h2d"].append(call_anatomy.measure(copies.h2d, None, lambda: sync(device), h2d_gbps))
    finally:
        engine.mover.driver = recorder.inner  # type: ignore[attr-defined]
    return {op: call_anatomy.medians(rows) for op, rows in samples.items()}
