"""Small helpers shared by the benchmarks: timing, the memcpy ceiling, and option parsing."""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvdepot.transfer.numa import near_gpu


def positive(value: str) -> int:
    """An option's whole number >= 1 (argparse names the option and quotes this on a bad one)."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    return int(value)


def non_negative(value: str) -> int:
    """An option's whole number >= 0 (where 0 means "none"), as ``positive`` reports a bad one."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 0")
    return int(value)


def size_list(unit: str, example: str) -> Callable[[str], list[int]]:
    """An option's comma-separated sizes in ``unit``, each >= 1."""

    def parse(value: str) -> list[int]:
        try:
            return [positive(part.strip()) for part in value.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{value!r}: expected {unit} sizes >= 1, comma-separated (e.g. {example})") from None

    return parse


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` with the device synchronized around each run."""
    for _ in range(warmup):
        fn()
        sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Memcpy:
    """Plain copies of ``nbytes`` between pinned host memory and the device (the ceiling), kept
    allocated so that a benchmark can time one right beside each of its own operations.

    On a CPU-only machine every direction is a host memcpy of the same size (``both`` is None).
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device, pin = device, device.type == "cuda"
        # Pinned from the GPU's CPUs, as the engines' arenas are (``transfer/numa.py``): the
        # ceiling is the copy between the GPU and its own node's memory.
        with near_gpu(device):
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.host.random_(0, 255)
            self._host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pin else None
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if pin:
            self._dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._up, self._down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)

    def d2h(self) -> None:
        self.host.copy_(self.dev, non_blocking=True)

    @property
    def both(self) -> Callable[[], None] | None:
        """Both directions at once, on two streams (counts twice the bytes); None on CPU."""
        if self.device.type != "cuda":
            return None

        def run() -> None:
            with torch.cuda.stream(self._up):
                self.dev.copy_(self.host, non_blocking=True)
            with torch.cuda.stream(self._down):
                self._host2.copy_(self._dev2, non_blocking=True)

        return run


def memcpy_ceiling(nbytes: int, device: torch.device, reps: int) -> tuple[float, float, float]:
    """GB/s of plain copies of ``nbytes``: host->device, device->host (pinned when CUDA), and both
    directions at once (total bytes over time; NaN on CPU)."""
    copies = Memcpy(nbytes, device)
    h2d = median_seconds(copies.h2d, device, reps)
    d2h = median_seconds(copies.d2h, device, reps)
    both_s = median_seconds(copies.both, device, reps) if copies.both is not None else float("nan")
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9, 2 * nbytes / both_s / 1e9


def paired_seconds(
    op: Callable[[], Any], ceiling: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1,
    before: Callable[[], Any] | None = None, clock: Callable[[Callable[[], Any]], float] | None = None,
) -> tuple[float, float, float]:
    """(median seconds of ``op``, of ``ceiling``, median of the per-pair ratios ceiling/op), the
    two timed alternately. Single runs on the H200 moved by 10-20% with what else crossed the
    host's PCIe switch; a drift like that hits both members of a pair alike. ``before`` runs
    ahead of each ``op``, off the clock (a load's lookup, which an engine's scheduler makes).
    ``clock``: the seconds one call takes (default: host time, the device synchronized around it)."""

    def host_clock(fn: Callable[[], Any]) -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    timed = clock or host_clock
    for _ in range(warmup):
        if before is not None:
            before()
        op()
        ceiling()
        sync(device)
    ops, ceilings = [], []
    for _ in range(reps):
        for fn, times in ((op, ops), (ceiling, ceilings)):
            if before is not None and fn is op:
                before()
            times.append(timed(fn))
    ratio = statistics.median(c / o for c, o in zip(ceilings, ops, strict=True))
    return statistics.median(ops), statistics.median(ceilings), ratio


def gpu_work(device: torch.device) -> Callable[[float], None]:
    """A function that enqueues ``seconds`` of GPU busy-waiting on the current stream (the stand-in
    for a forward: no memory traffic, no SMs worth counting), its clock calibrated here once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1 << 16)  # (a first launch pays module loading)
    start.record()
    torch.cuda._sleep(1 << 22)
    end.record()
    end.synchronize()
    cycles_per_s = (1 << 22) / (start.elapsed_time(end) / 1e3)
    return lambda seconds: torch.cuda._sleep(max(1, int(seconds * cycles_per_s)))


def behind_work_seconds(
    op: Callable[[], Any], ceiling: Callable[[], Any], device: torch.device, reps: int, work_s: float,
    before: Callable[[], Any] | None = None,
) -> tuple[float, float, float]:
    """``paired_seconds`` for an operation called while the GPU is still busy, as an engine calls
    it: a store right after enqueueing the forward that wrote its KV (TensorRT-LLM's
    ``wait_for_save``), a load behind the previous step's work. Each run enqueues ``work_s`` of
    GPU work, records an event at its end, calls the function and records another event once it
    has returned: the time between the two events is what the GPU saw, from the work's end to
    the operation's (a store's ``wait`` and the memcpy's synchronize both return on the host
    first, so both pay that wake-up). The host's own latency before the first copy counts only
    where it outlasts the work. CUDA only."""
    work = gpu_work(device)

    def behind(fn: Callable[[], Any]) -> float:
        sync(device)
        done, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        work(work_s)
        done.record()
        fn()
        end.record()
        end.synchronize()
        return done.elapsed_time(end) / 1e3

    return paired_seconds(op, ceiling, device, reps, before=before, clock=behind)


def compute_share(transfer: Callable[[], Any], seconds: float, device: torch.device, reps: int = 3) -> float:
    """Throughput of a bf16 matmul loop on another stream while ``transfer`` runs, over alone (1.0:
    the transfer costs compute nothing). Copy engines use no SMs; gather kernels and copying
    kernels do, and this is the number that says how much. ``seconds``: how long one transfer
    takes (the loop is sized to run inside it, after a GPU sleep that lets the transfer start).
    The median of ``reps`` pairs, each a loop alone and then one beside the transfer: a GPU whose
    clocks drift over the run (heat, power) would otherwise read the drift as the transfer's cost."""
    side = torch.cuda.Stream(device)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(a)

    def loop(count: int, sleep_cycles: int = 0) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            start.record()
            for _ in range(count):
                torch.mm(a, a, out=out)
            end.record()
        return start, end

    def elapsed(events: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3

    elapsed(loop(3))  # warm-up (cuBLAS picks its kernel)
    one = elapsed(loop(20)) / 20
    sleep = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        sleep[0].record()
        torch.cuda._sleep(1 << 20)
        sleep[1].record()
    cycles_per_s = (1 << 20) / elapsed(sleep)
    lead = 0.25 * seconds  # the matmuls start once the transfer's copies are under way
    count = max(2, int(0.6 * seconds / one))
    ratios = []
    for _ in range(reps):
        alone = elapsed(loop(count))
        events = loop(count, int(lead * cycles_per_s))
        transfer()
        ratios.append(alone / elapsed(events))
        sync(device)
    return statistics.median(ratios)


def gpu_timeline(fn: Callable[[], Any]) -> dict[str, float]:
    """Where one call's wall time goes on the GPU, from a torch.profiler trace (CUDA only):

    lead-in ms   from the call until the first GPU activity starts (host-side work)
    copy ms      time the copy engines are busy (union of memcpy intervals)
    kernel ms    time kernels run (union), e.g. gathers and scatters
    idle ms      GPU span in which neither runs (gaps between dependent operations)
    tail ms      from the last GPU activity's end until the call returned and synchronized
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, record_function("kvdepot.timed"):
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    outer = next(e for e in events if e.name == "kvdepot.timed")
    # The record_function above also appears on the GPU (a user annotation spanning the call's
    # GPU work): it is not work, so it is left out.
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
           and e.time_range.end > e.time_range.start and e.name != outer.name]
    if not gpu:
        return {}
    copies = [(e.time_range.start, e.time_range.end) for e in gpu if "memcpy" in e.name.lower()]
    kernels = [(e.time_range.start, e.time_range.end) for e in gpu if "memcpy" not in e.name.lower()]
    start, end = min(e.time_range.start for e in gpu), max(e.time_range.end for e in gpu)
    busy = _union(copies + kernels)
    return {"lead-in ms": (start - outer.time_range.start) / 1e3, "copy ms": _union(copies) / 1e3,
            "kernel ms": _union(kernels) / 1e3, "idle ms": (end - start - busy) / 1e3,
            "tail ms": (outer.time_range.end - end) / 1e3}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def print_table(title: str, rows: Sequence[dict[str, Any]]) -> None:
    """A plain fixed-width table (what the README and closing notes quote)."""
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(title)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def c_helper(package: str = "kvdepot") -> str:
    """Where a tree's copy lists and driver calls come from, for a title: "C helper" (its
    ``transfer.native`` was built), "Python" (not built), or "Python (no C helper in this tree)"
    (a tree from before it): the 256 KiB rows differ by it (issue 19)."""
    try:
        native = importlib.import_module(f"{package}.transfer.native")
    except ImportError:
        return "Python (no C helper in this tree)"
    return "C helper" if native.NATIVE is not None else "Python"


class HostSteal:
    """Milliseconds per second that the hypervisor ran other guests while this VM's CPUs wanted to
    run ("steal" in ``/proc/stat``, summed over CPUs), since the last reading. The GPU hosts here
    are VMs whose processes have slow phases (every host step ~2x slower, the 256 KiB store 8–12
    points down, issue 19); a high figure beside such a row says the time was taken from the
    process, not spent by it. None where the kernel does not say (no ``/proc/stat``, no steal field)."""

    STAT = "/proc/stat"

    def __init__(self) -> None:
        self._last = (time.perf_counter(), self._ticks())

    def _ticks(self) -> int | None:
        try:
            with open(self.STAT) as f:
                fields = f.readline().split()
        except OSError:
            return None
        return int(fields[8]) if len(fields) > 8 and fields[0] == "cpu" else None

    def ms_per_s(self) -> float | None:
        (t0, ticks0), now = self._last, (time.perf_counter(), self._ticks())
        self._last = now
        if ticks0 is None or now[1] is None or now[0] <= t0:
            return None
        return (now[1] - ticks0) / os.sysconf("SC_CLK_TCK") * 1e3 / (now[0] - t0)


def host_python_us(reps: int = 7) -> float:
    """Median microseconds of a fixed piece of plain Python on this host (a dict filled and
    emptied: the kind of work an operation's bookkeeping does), printed beside the rows whose
    figure the host's Python sets: a small block's idle-GPU store waits ~75 µs of it before its
    first copy. On one H100 host every step of that lead took twice as long as on another, with
    or without DMA before it (issue 19, seventeenth pass), so a row is read against this."""

    def reference() -> None:
        table: dict[int, tuple[int, int]] = {}
        for i in range(2000):
            table[i] = (i, 3 * i)
        for i in range(2000):
            table.pop(i)

    return median_seconds(reference, torch.device("cpu"), reps, warmup=0) * 1e6
