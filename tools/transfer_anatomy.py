"""Where a transfer's time goes when a store and a load run together (CUDA only).

For one pool shape and mover, with the same 8K-token operations as ``bench transfer``:
  issue ms     how long ``engine.store`` / ``engine.retrieve`` take to return (host time, no sync)
  wall ms      the same call until the copies are done
  hop          from the store call until the engine's issuer thread starts issuing it, and for
               how long it issues
  back to back 2 stores issued at once, waited for together (a step storing several requests)
  both         store then load (what ``bench transfer`` times; the other order serializes by
               design: a load makes the caller's stream wait, and a later store waits for that
               stream), with when the issuer and the caller each issued; and the load started
               only once the store's copies are all issued
  directions   for "store then load", when each direction's first copy starts and last one ends,
               relative to the call (torch.profiler)
  --profile    cProfile of the host side of one store and one retrieve
  --stamps     per thread, when the copy list was built and the first and last driver calls
               returned (batch mover), ms from the call: where a move's start latency goes
  --trace F    Chrome trace of one "store then load" (streams, copies, kernels) written to F
  --switch-interval S   run with CPython's GIL switch interval set to S seconds (a diagnostic)

    python tools/transfer_anatomy.py [--layers 32 --head-dim 128 --tokens-per-block 32] [--mover staged] [--profile]
"""
import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time

import torch

from kvdepot.bench.common import memcpy_ceiling
from kvdepot.config import load_config
from kvdepot.engine import CacheEngine

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--head-dim", type=int, default=128)
ap.add_argument("--tokens-per-block", type=int, default=32)
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--mover", default="staged")
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--profile", action="store_true")
ap.add_argument("--stamps", action="store_true")
ap.add_argument("--trace", default=None)
ap.add_argument("--switch-interval", type=float, default=None,
                help="sys.setswitchinterval for this run (seconds; CPython's default 0.005): is a thread waiting for the GIL?")
a = ap.parse_args()
if a.switch_interval is not None:
    sys.setswitchinterval(a.switch_interval)

B = a.tokens_per_block
moved = a.tokens // B
pool = torch.empty((moved * 3, a.layers, 2, a.kv_heads * B * a.head_dim), dtype=torch.bfloat16, device="cuda")
pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
nbytes = moved * pool[0].numel() * 2
config = load_config(host_capacity_gb=(3 * nbytes + 1) / 1e9, transfer_mover=a.mover)
engine = CacheEngine.for_pool(pool, B, config)
engine.wait_arena()
rng, counter = random.Random(0), iter(range(1 << 40))


def batch():
    keys = engine.chunk_keys([next(counter) % 100_000 for _ in range(a.tokens)])
    return keys, rng.sample(range(pool.shape[0]), moved)


def store(keys_ids):
    handle = engine.store(keys_ids[0], keys_ids[1])
    return handle


def load(keys, ids):
    engine.lookup(keys)
    if engine.retrieve(keys, ids) != a.tokens:
        raise RuntimeError("load found its chunks evicted")


for _ in range(4):  # fill the arena once over: stores then evict, as in a busy cache
    store(batch()).wait()
targets = rng.sample(range(pool.shape[0]), moved)
pending = [batch() for _ in range(8 * a.reps + 16)]
held = None  # stored after the store timings (which would evict it); lookups keep it recent


def timed(fn):
    """(issue ms, wall ms) medians: time to return, and until the device is done (and a returned
    store handle: its copies are issued by the engine's issuer thread)."""
    issue, wall = [], []
    for i in range(a.reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = fn()
        t1 = time.perf_counter()
        if handle is not None:
            handle.wait()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:
            issue.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
    return statistics.median(issue), statistics.median(wall)


both_marks = []  # per "store then load": (store call, load call, load returned) perf_counter times


def store_first():
    t0 = time.perf_counter()
    h = store(pending.pop())
    t1 = time.perf_counter()
    load(held[0], targets)
    both_marks.append((t0, t1, time.perf_counter()))
    h.wait()


def store_issued_then_load():
    """The load only once the store's copies are all issued: does 'both' reach its ceiling when
    the two issues do not overlap in time?"""
    n = len(issue_marks)
    h = store(pending.pop())
    while len(issue_marks) == n:
        time.sleep(20e-6)
    load(held[0], targets)
    h.wait()


def stores_back_to_back(k=2):  # the arena holds three operations: more in flight would drop
    handles = [store(pending.pop()) for _ in range(k)]
    for h in handles:
        h.wait()
        if h.chunks != moved * B // config.chunk_size:
            raise RuntimeError("a store was dropped")


issue_marks = []  # (entered, left) of the mover's gather: when the issuer thread issues a store
inner_gather = engine.mover.gather_many


def marked_gather(views, copies):
    entered = time.perf_counter()
    inner_gather(views, copies)
    issue_marks.append((entered, time.perf_counter()))


engine.mover.gather_many = marked_gather


h2d, d2h, bidir = memcpy_ceiling(nbytes, torch.device("cuda"), a.reps)
print(f"shape L{a.layers} H{a.kv_heads} D{a.head_dim} tpb{B}, {moved} blocks of {nbytes / moved / 2**20:.3f} MiB, "
      f"{nbytes / 2**20:.0f} MiB per op, mover {a.mover}")
print(f"memcpy: h2d {h2d:.1f} GB/s  d2h {d2h:.1f}  both {bidir:.1f}  -> bound {nbytes / h2d * 1e3 / 1e9:.2f} / "
      f"{nbytes / d2h * 1e3 / 1e9:.2f} / {2 * nbytes / bidir * 1e3 / 1e9:.2f} ms")
calls = []
s_issue, s_wall = timed(lambda: calls.append(time.perf_counter()) or store(pending.pop()))
hop = statistics.median((m[0] - c) * 1e3 for c, m in zip(calls[1:], issue_marks[-a.reps:], strict=True))
gather = statistics.median((m[1] - m[0]) * 1e3 for m in issue_marks[-a.reps:])
b2b_issue, b2b_wall = timed(stores_back_to_back)
held = batch()
store(held).wait()
l_issue, l_wall = timed(lambda: load(held[0], targets))
print(f"store     issue {s_issue:.2f} ms  wall {s_wall:.2f} ms  ratio {nbytes / s_wall / 1e6 / d2h:.3f}  "
      f"(call -> issuer starts {hop:.3f} ms, issuer issues for {gather:.2f} ms)")
print(f"2 stores back to back: wall {b2b_wall:.2f} ms  ratio {2 * nbytes / b2b_wall / 1e6 / d2h:.3f}")
print(f"retrieve  issue {l_issue:.2f} ms  wall {l_wall:.2f} ms  ratio {nbytes / l_wall / 1e6 / h2d:.3f}")
for name, fn in (("store then load", store_first), ("store issued, then load", store_issued_then_load)):
    n_marks = len(issue_marks)
    issue, wall = timed(fn)
    print(f"both: {name:23s} wall {wall:.2f} ms  ratio {2 * nbytes / wall / 1e6 / bidir:.3f}")
    if fn is store_first:  # when the store's issuer ran, against the caller's load issue (ms from the store call)
        rows = [(m[0] - c0, m[1] - c0, l0 - c0, l1 - c0) for (c0, l0, l1), m in
                zip(both_marks[-a.reps:], issue_marks[n_marks:][-a.reps:], strict=True)]
        med = [statistics.median(r[k] for r in rows) * 1e3 for k in range(4)]
        print(f"  issuer issues {med[0]:.2f} -> {med[1]:.2f} ms; the caller issues the load {med[2]:.2f} -> {med[3]:.2f} ms")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    store_first()
    torch.cuda.synchronize()
if a.trace:
    prof.export_chrome_trace(a.trace)
events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
start = min(e.time_range.start for e in prof.events())
for label, tag in (("d2h (store)", "dtoh"), ("h2d (load)", "htod"), ("kernels", None)):
    if tag is None:
        sel = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
               and e.time_range.end > e.time_range.start and not e.name.startswith("ProfilerStep")]
        sel = [e for e in sel if "annotation" not in str(getattr(e, "device_resource_id", "")).lower()]
    else:
        sel = [e for e in events if tag in e.name.lower().replace(" ", "")]
    if sel:
        first = min(e.time_range.start for e in sel) - start
        last = max(e.time_range.end for e in sel) - start
        busy = sum(e.time_range.end - e.time_range.start for e in sel)
        print(f"  {label:12s} n={len(sel):4d} first start {first / 1e3:6.2f} ms  last end {last / 1e3:6.2f} ms  "
              f"sum {busy / 1e3:6.2f} ms  names {sorted({e.name for e in sel})[:3]}")

if a.stamps:
    import threading

    from kvdepot.transfer import batch as batch_module
    from kvdepot.transfer import cuda_batch

    stamps: list[tuple[str, str, float]] = []  # (thread, what, perf_counter)
    inner_runs, inner_call = batch_module.copy_runs, cuda_batch.memcpy_batch

    def stamped_runs(*args):
        stamps.append((threading.current_thread().name, "list", time.perf_counter()))
        out = inner_runs(*args)
        stamps.append((threading.current_thread().name, "listed", time.perf_counter()))
        return out

    def stamped_call(*args):
        inner_call(*args)
        stamps.append((threading.current_thread().name, "call", time.perf_counter()))

    batch_module.copy_runs, cuda_batch.memcpy_batch = stamped_runs, stamped_call
    # the stores last: the arena holds three operations, and a store evicts ``held`` unless a
    # lookup keeps it recent (as the loads do)
    for name, fn in (("retrieve", lambda: load(held[0], targets)), ("store then load", store_first),
                     ("store", lambda: store(pending.pop()))):
        rows: dict[str, list[list[float]]] = {}
        for _ in range(a.reps):
            torch.cuda.synchronize()
            del stamps[:]
            t0 = time.perf_counter()
            handle = fn()
            returned = time.perf_counter() - t0
            if handle is not None:
                handle.wait()
            torch.cuda.synchronize()
            for thread in dict.fromkeys(s[0] for s in stamps):
                mine = [(w, t - t0) for th, w, t in stamps if th == thread]
                calls = [t for w, t in mine if w == "call"]
                nan = float("nan")  # a thread that built no list, or made no driver call
                marks = [next((t for w, t in mine if w == "list"), nan), next((t for w, t in mine if w == "listed"), nan),
                         calls[0] if calls else nan, calls[-1] if calls else nan, returned, len(calls)]
                rows.setdefault(thread, []).append(marks)
        for thread, marks in rows.items():
            med = [statistics.median(m[k] for m in marks) * (1e3 if k < 5 else 1) for k in range(6)]
            print(f"stamps {name:16s} {thread:20s} list {med[0]:.2f} -> {med[1]:.2f} ms, first call back {med[2]:.2f}, "
                  f"last {med[3]:.2f} ({med[5]:.0f} calls); the caller's call returned at {med[4]:.2f}")
    batch_module.copy_runs, cuda_batch.memcpy_batch = inner_runs, inner_call

if a.profile:
    store(held).wait()  # the stores above evicted it
    prof_c = cProfile.Profile()
    for _ in range(3):
        torch.cuda.synchronize()
        prof_c.enable()
        h = store(pending.pop())
        load(held[0], targets)
        prof_c.disable()
        h.wait()
    pstats.Stats(prof_c).sort_stats("cumulative").print_stats(30)
engine.wait_all()
engine.close()
