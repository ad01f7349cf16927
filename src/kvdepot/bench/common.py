"""Small helpers shared by the benchmarks: timing, the memcpy ceiling, and table printing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


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


def memcpy_ceiling(nbytes: int, device: torch.device, reps: int) -> tuple[float, float, float]:
    """GB/s of plain copies of ``nbytes``: host->device, device->host (pinned when CUDA), and both
    directions at once on two streams (total bytes over time; NaN on CPU).

    On a CPU-only machine both directions are a host memcpy of the same size.
    """
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = median_seconds(lambda: dev.copy_(host, non_blocking=True), device, reps)
    d2h = median_seconds(lambda: host.copy_(dev, non_blocking=True), device, reps)
    if device.type != "cuda":
        return nbytes / h2d / 1e9, nbytes / d2h / 1e9, float("nan")
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both() -> None:
        with torch.cuda.stream(up):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(down):
            host2.copy_(dev2, non_blocking=True)

    both_s = median_seconds(both, device, reps)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9, 2 * nbytes / both_s / 1e9


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
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
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
