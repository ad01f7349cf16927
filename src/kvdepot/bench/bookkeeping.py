"""``kvdepot bench bookkeeping``: the host-side cost of ``CacheEngine`` store / retrieve per pool
shape, without any copy (CPU).

Two paths through the engine, on a CPU pool shaped like TensorRT-LLM's cross-layer pool (never
touched, so never backed by memory):

``bookkeeping``  a mover that copies nothing: keys, block-id checks, slot booking (evicting LRU
                 chunks: the arena holds three operations and is filled first), pins, commits.
``batch``        the batch mover with everything real but the driver call, which is stubbed (it
                 copies nothing and returns at once), on ``ImmediateStreams``: a store still goes
                 through the issuer thread, a load through the side-stream path — the GPU's code
                 paths, with their thread hand-off. Timed from the call: when it returned, when the
                 first driver call was entered (the copy engines' start, less the driver's own
                 time) and when the last one returned (everything issued).

Keys and block ids are drawn before the clock, as ``bench transfer`` does. Host time per operation
is what stands between a call and its first copy, and what keeps small operations (256 blocks of
256 KiB: 1.2 ms of PCIe) from the copy engines' speed (docs/benchmarks.md, issue 19). On the H200's
host the bookkeeping path predicted a 32-chunk store's bookkeeping within 10% (docs/perf-notes.md).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import pstats
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.transfer.base import PerChunk

MODELS = {"8b": (32, 8, 128), "1b": (16, 8, 64)}  # layers, KV heads, head dim (Llama-3-8B, Llama-3.2-1B)


class NullMover(PerChunk):
    """A mover that copies nothing: the engine's bookkeeping is all that is left to time."""

    def gather(self, views: Sequence[Any], block_ids: Sequence[int], dst: Any, first: int = 0) -> None:
        pass

    def scatter(self, src: Any, views: Sequence[Any], block_ids: Sequence[int], first: int = 0) -> None:
        pass

    def gather_many(self, views: Sequence[Any], copies: Sequence[Any]) -> None:
        pass

    def scatter_many(self, copies: Sequence[Any], views: Sequence[Any]) -> None:
        pass


@dataclass
class Stamps:
    """When each stubbed driver call was entered and left (perf_counter seconds), its direction,
    and what it was handed (its copy list and window, for the bytes)."""

    calls: list[tuple[float, float, bool, Any, int, int]] = field(default_factory=list)  # (enter, leave, to_host, list, lo, hi)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def first(self, to_host: bool) -> float:
        return min(c[0] for c in self.calls if c[2] == to_host)

    def last(self, to_host: bool) -> float:
        return max(c[1] for c in self.calls if c[2] == to_host)

    def longest_gap(self, to_host: bool) -> float:
        """The longest time between the calls of one direction with none of them in the driver:
        where the copy engines would run dry if the copies took no longer than their calls."""
        gap, busy_until = 0.0, None
        for enter, leave, *_ in sorted(c for c in self.calls if c[2] == to_host):
            if busy_until is not None:
                gap = max(gap, enter - busy_until)
            busy_until = leave if busy_until is None else max(busy_until, leave)
        return gap

    def per_copy(self, to_host: bool) -> float:
        """Seconds spent in the (stubbed) driver per copy: what ``--driver-us-per-copy`` asked
        for, as it came out (with the stamps' own cost in it)."""
        calls = [c for c in self.calls if c[2] == to_host]
        copies = sum(hi - lo for *_, lo, hi in calls)
        return sum(leave - enter for enter, leave, *_ in calls) / copies if copies else float("nan")

    def engines(self, to_host: bool, gbps: float) -> tuple[float, float]:
        """(idle, end) of a simulated copy engine fed by these calls at ``gbps``: each call's
        copies start once it has returned (the driver hands a batch over whole) and after the
        ones before; idle counts the time it ran dry between the first copy and the last. Whether
        the host work stays ahead of a GPU's copies, told on a machine without one (issue 19)."""
        idle, busy = 0.0, None
        for _, leave, _, copies, lo, hi in sorted((c for c in self.calls if c[2] == to_host), key=lambda c: c[1]):
            nbytes = int(copies.table[2, lo:hi].sum())
            if busy is not None and leave > busy:
                idle += leave - busy
            busy = max(busy if busy is not None else leave, leave) + nbytes / (gbps * 1e9)
        return idle, busy if busy is not None else float("nan")


class StubDriver:
    """A batch driver whose call copies nothing: it stamps when it was entered and left, and
    goes through a foreign call (libc's memset, via ctypes, as the real one) so that the GIL is
    let go as the real call lets it go. With ``us_per_copy`` > 0 the memset is sized to take that
    long per copy, the real call's host time (~1.3 us per copy on the H200's host,
    docs/benchmarks.md): calibrated at start and then set by the rate each call's memset ran at
    (sized from the start alone, it took ~2x as long as asked in place on the dev VM), and topped
    up by small memsets where it ran faster than that rate (a CI run's call once took 0.4 of the
    0.5 us per copy asked), so that a call never takes less than asked; the
    ``driver us/copy`` column says what came out, the stamps' own ~0.3 us included, and a wait
    for the GIL after the call where two threads issue at once). The memset also sweeps the CPU
    caches, so the host work around it reads slower than beside the real driver; 0 (the default)
    counts only our own work.
    ``pool``: the pool's [first, last) address, which tells a load's copies from a store's."""

    def __init__(self, stamps: Stamps, us_per_copy: float) -> None:
        self.stamps, self.pool = stamps, (0, 0)
        self._memset = ctypes.CDLL(None).memset
        self._memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self._scratch = ctypes.create_string_buffer(1 << 24)
        self._bytes_per_us = self._calibrate() if us_per_copy > 0 else 0.0
        self.us_per_copy = us_per_copy

    def _calibrate(self) -> float:
        size, reps = 1 << 20, 50
        best = min(self._time(size) for _ in range(reps))
        return size / (best * 1e6)

    def _time(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self._memset(self._scratch, 0, nbytes)
        return time.perf_counter() - t0

    def stream(self, views: Sequence[Any]) -> Any:
        return 7  # as if on a CUDA stream

    def pinned(self, hosts: Mapping[int, Any]) -> bool:
        return True  # as if the arena were pinned

    def lane(self, stream: Any) -> Any:
        return 8

    def join(self, stream: Any, lane: Any) -> None:
        pass

    def copy(self, copies: Any, lo: int, hi: int, stream: Any) -> None:
        enter = time.perf_counter()
        to_host = not self.pool[0] <= int(copies.dst[lo]) < self.pool[1]
        want_us = (hi - lo) * self.us_per_copy
        nbytes = min(len(self._scratch), int(want_us * self._bytes_per_us))
        began = time.perf_counter()
        self._memset(self._scratch, 0, nbytes)
        took = (time.perf_counter() - began) * 1e6
        if nbytes and took > 0:  # follow memset's rate as it runs here (its size, the caches, a busy neighbour)
            self._bytes_per_us = 0.7 * self._bytes_per_us + 0.3 * nbytes / took
        while (time.perf_counter() - began) * 1e6 < want_us:  # ran faster than its rate said: never less than asked
            self._memset(self._scratch, 0, min(nbytes, 1 << 16) or 1)
        with self.stamps.lock:
            self.stamps.calls.append((enter, time.perf_counter(), to_host, copies, lo, hi))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="8b,1b", help=f"pool shapes, comma-separated: {', '.join(MODELS)} (layers, KV heads, head dim of Llama-3-8B / -3.2-1B)")
    parser.add_argument("--tokens-per-block", default="32,8", help="tokens per pool block, comma-separated (each model is run with each)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per kvdepot chunk")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per operation (issue 19: 256)")
    parser.add_argument("--paths", default="bookkeeping,batch", help="bookkeeping (a mover that copies nothing), batch (the batch mover, driver call stubbed), comma-separated")
    parser.add_argument("--reps", type=int, default=200, help="timed operations of each kind")
    parser.add_argument("--driver-us-per-copy", type=float, default=0.0,
                        help="batch path: host time the stubbed driver call spends per copy, GIL released (H200 host: ~1.3; "
                             "emulated by a memset, which also sweeps the caches); 0: our own host work only")
    parser.add_argument("--sweep-mib", type=int, default=0,
                        help="MiB written before each timed operation, as the last operation's DMA sweeps the host's "
                             "caches on a GPU (H200 host: numpy calls then cost 5-15x their hot-loop time); 0: none")
    parser.add_argument("--pcie-gbps", type=float, default=55.0,
                        help="batch path: the simulated copy engine's rate, GB/s (the H200's pinned memcpy: 55)")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top 25 functions of each path and shape")
    add_output_arguments(parser)


@dataclass
class Rig:
    engine: Any
    batches: list[tuple[list, list[int]]]
    held: tuple[list, list[int]]
    tokens: int
    sweep: Callable[[], None] = lambda: None  # sweeps the caches (``--sweep-mib``) before a timed op


def _sweeper(mib: int) -> Callable[[], None]:
    """A function that writes ``mib`` MiB (libc memset, GIL released): on a GPU host every
    operation follows the last one's DMA, which leaves the CPU caches cold; hot-loop timings
    miss that (issue 19: the H200 host's first copy came 2-5x later than this bench predicted)."""
    if mib <= 0:
        return lambda: None
    memset = ctypes.CDLL(None).memset
    memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(mib << 20)
    return lambda: memset(buf, 1, mib << 20)


def _build(layers: int, heads: int, dim: int, tpb: int, args: argparse.Namespace, mover: Any, streams: Any) -> Rig:
    """An engine over an untouched pool of three operations' blocks, its arena filled once over
    (so that every timed store evicts), and the timed operations' keys and block ids."""
    import torch

    from kvdepot.config import load_config
    from kvdepot.engine import CacheEngine
    from kvdepot.layout import PoolLayout

    moved = args.blocks - args.blocks % (args.chunk_size // tpb)
    pool = torch.empty((moved * 3, layers, 2, heads * tpb * dim), dtype=torch.bfloat16)
    op_bytes = moved * pool[0].numel() * pool.element_size()
    config = load_config(chunk_size=args.chunk_size, host_capacity_gb=(3 * op_bytes + 1) / 1e9, pin_host_memory="false")
    layout = PoolLayout.from_pool(pool, tpb, args.chunk_size)
    engine = CacheEngine(layout, config, mover=mover, streams=streams)
    engine.register_pool(pool)
    rng, counter = random.Random(0), iter(range(1 << 40))

    def batch() -> tuple[list, list[int]]:
        tokens = [next(counter) % 100_000 for _ in range(moved * tpb)]
        return engine.chunk_keys(tokens), rng.sample(range(pool.shape[0]), moved)

    batches = [batch() for _ in range(4 + 2 * args.reps)]
    for keys, ids in batches[:4]:  # fill the arena once over: every timed store evicts
        engine.store(keys, ids).wait()
    return Rig(engine, batches[4:], batches[3], moved * tpb, _sweeper(getattr(args, "sweep_mib", 0)))


def _store(rig: Rig, n: int) -> Any:
    keys, ids = rig.batches[n]
    handle = rig.engine.store(keys, ids)
    if handle.chunks != len(keys):  # a dropped store would time as free
        raise RuntimeError("store placed fewer chunks than asked: the arena did not evict")
    return handle


def _retrieve(rig: Rig, lease: int) -> None:
    keys, ids = rig.held
    if rig.engine.retrieve(keys, ids, num_blocks=len(ids), lease=lease) != rig.tokens:
        raise RuntimeError("retrieve loaded fewer tokens than held")


def _bookkeeping(rig: Rig, reps: int) -> dict[str, list[float]]:
    """Microseconds per call of each kind, one sample per repetition (a mover that copies nothing)."""
    engine, held = rig.engine, rig.held[0]
    times: dict[str, list[float]] = {"store": [], "lookup": [], "lookup+lease": [], "retrieve": []}
    for n in range(reps):
        rig.sweep()
        t0 = time.perf_counter()
        _store(rig, n)
        t1 = time.perf_counter()
        engine.lookup(held)  # as bench transfer does; also keeps ``held`` recently used
        t2 = time.perf_counter()
        engine.lookup(held, lease=n)  # as the adapters do: pin until the load
        t3 = time.perf_counter()
        rig.sweep()  # off the clock: the load starts cold, as after the last operation's DMA
        t4 = time.perf_counter()
        _retrieve(rig, n)
        t5 = time.perf_counter()
        for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
            times[name].append(t * 1e6)
    return times


def _batch(rig: Rig, reps: int, stamps: Stamps, gbps: float) -> dict[str, list[tuple[float, ...]]]:
    """Per op, ``_row``'s figures in us from the call."""
    engine, held = rig.engine, rig.held[0]
    out: dict[str, list[tuple[float, ...]]] = {"store": [], "retrieve": [], "both: store": [], "both: retrieve": []}
    for n in range(reps):
        rig.sweep()
        stamps.calls.clear()
        t0 = time.perf_counter()
        handle = _store(rig, 2 * n)
        t1 = time.perf_counter()
        handle.wait()
        out["store"].append(_row(stamps, True, t0, t1, gbps))
        engine.lookup(held, lease=n)
        rig.sweep()
        stamps.calls.clear()
        t0 = time.perf_counter()
        _retrieve(rig, n)
        t1 = time.perf_counter()
        out["retrieve"].append(_row(stamps, False, t0, t1, gbps))
        # Both at once, as bench transfer's row: a store, then a load right behind it.
        engine.lookup(held, lease=("both", n))
        rig.sweep()
        stamps.calls.clear()
        t0 = time.perf_counter()
        handle = _store(rig, 2 * n + 1)
        t1 = time.perf_counter()
        _retrieve(rig, ("both", n))  # type: ignore[arg-type]
        t2 = time.perf_counter()
        handle.wait()
        out["both: store"].append(_row(stamps, True, t0, t1, gbps))
        out["both: retrieve"].append(_row(stamps, False, t0, t2, gbps))
    return out


def _row(stamps: Stamps, to_host: bool, t0: float, returned: float, gbps: float) -> tuple[float, ...]:
    """(call returned, first driver call entered, last one left, longest gap, simulated engines'
    idle time and end) in us from ``t0``, and the driver's time per copy in us."""
    idle, end = stamps.engines(to_host, gbps)
    return ((returned - t0) * 1e6, (stamps.first(to_host) - t0) * 1e6, (stamps.last(to_host) - t0) * 1e6,
            stamps.longest_gap(to_host) * 1e6, idle * 1e6, (end - t0) * 1e6, stamps.per_copy(to_host) * 1e6)


def _check_idle(engine: Any) -> None:
    stats = engine.stats()
    if stats.live_leases or stats.pinned_chunks or stats.inflight_transfers:
        raise RuntimeError(f"leftover leases/pins/transfers: {stats}")
    engine.close()


def run(args: argparse.Namespace) -> list[dict]:
    shapes = [(m, int(t)) for m in args.models.split(",") for t in args.tokens_per_block.split(",")]
    paths = args.paths.split(",")
    report = Report(args, steps=len(shapes) * len(paths), name="bench bookkeeping",
                    bars=Bars(("shape", "path", "op"), ("call us", "first copy us", "all issued us", "longest gap us"),
                              "us per call"))
    columns = ("call us", "first copy us", "all issued us", "longest gap us", "engines idle us", "copies end us",
               "driver us/copy")
    report.note(f"kvdepot bench bookkeeping — host time per operation of {args.blocks} blocks, no copies (CPU), "
                f"{args.reps} reps, medians in us from the call: 'call' until it returned, 'first copy' until the "
                "first (stubbed) driver call, 'all issued' until the last one returned; 'longest gap': the longest time "
                "between its driver calls with none in the driver (a store's hand-off to its issuer shows there); "
                f"'engines idle', 'copies end': a copy engine simulated at {args.pcie_gbps:g} GB/s, fed by those calls "
                "(each call's copies start once it has returned): its idle time after the first copy, and when it ends; "
                "'driver us/copy': the stubbed driver's time per copy as it came out (--driver-us-per-copy asks)")
    report.table("", shape=16, path=11, op=14)
    for model, tpb in shapes:
        layers, heads, dim = MODELS[model]
        shape = f"L{layers} H{heads} D{dim} tpb{tpb}"
        for path in paths:
            profiler = cProfile.Profile() if args.profile else None
            with report.step(f"{shape} {path}"):
                rows = _measure(path, (layers, heads, dim, tpb), args, profiler)
            for op, *values in rows:
                report.add({"shape": shape, "path": path, "op": op, **dict(zip(columns, values, strict=True))})
            if profiler:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return report.finish()


def _measure(path: str, shape: tuple[int, int, int, int], args: argparse.Namespace,
             profiler: cProfile.Profile | None) -> list[tuple[Any, ...]]:
    """Rows (op, and the ``columns`` of ``run``) of one path and shape (NaN: not a copy)."""
    from kvdepot.transfer.streams import CUDA, ImmediateStreams

    nan = float("nan")
    if path == "bookkeeping":  # inline, as on CPU: the copies' hand-off is the batch path's
        rig = _build(*shape, args, NullMover(), CUDA)
        with _profiling(profiler):
            times = _bookkeeping(rig, args.reps)
        _check_idle(rig.engine)
        return [(op, statistics.median(values), nan, nan, nan, nan, nan, nan) for op, values in times.items()]
    if path != "batch":
        raise SystemExit(f"unknown path {path!r}: expected bookkeeping or batch")
    from kvdepot.transfer import BatchBlockMover

    stamps = Stamps()
    driver = StubDriver(stamps, args.driver_us_per_copy)
    rig = _build(*shape, args, BatchBlockMover(driver=driver), ImmediateStreams())
    view = rig.engine._views[0]
    driver.pool = (view.data_ptr(), view.data_ptr() + view.numel())
    with _profiling(profiler):
        samples = _batch(rig, args.reps, stamps, args.pcie_gbps)
    _check_idle(rig.engine)
    return [(op, *(statistics.median(s[i] for s in values) for i in range(7))) for op, values in samples.items()]


@contextlib.contextmanager
def _profiling(profiler: cProfile.Profile | None) -> Iterator[None]:
    if profiler:
        profiler.enable()
    try:
        yield
    finally:
        if profiler:
            profiler.disable()
