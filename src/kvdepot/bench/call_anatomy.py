"""Where one operation of the batch mover spends its time, told by CUDA timing events and host
stamps (``kvdepot bench transfer --anatomy``). ``torch.profiler``, what ``--timeline`` uses,
doubled host times (issue 19, run AN) and could not say how far a call's host work lags its copies.

    total us      the call's wall time, the device synchronized before and after
    GPU lead us   from the call to the first driver call (an event on the caller's stream at the
                  call, one on the copy stream just before the first call)
    host lead us  the same on the host's clock: from the call until the first driver call was
                  entered (where the GPU lead is longer, the GPU was slow to reach the events)
    span us       from then until the last driver call's copies ran (an event after each call)
    tail us       the rest of the wall time: the host after the last copy (a store's commit, its
                  waiter's return) and the synchronize
    calls         driver calls (windows)
    idle us       how long a copy engine at the memcpy's rate of this run, fed each call's copies
                  once the call returned, would sit idle between its first copy and its last:
                  where the host's listing fell behind the copies

A plain memcpy of the same bytes is measured the same way (its lead is 0: the start event is its
own; its span is the copy). ``RecordingDriver`` wraps the mover's ``BatchDriver``, the seam the
mover already has for tests and CPU benches, only while ``measure`` runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvdepot.bench.bookkeeping import Stamps
from kvdepot.transfer.cuda_batch import BatchDriver

COLUMNS = ("total us", "GPU lead us", "host lead us", "span us", "tail us", "calls", "idle us")


def timing_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


class RecordingDriver:
    """A ``BatchDriver`` that passes every call to ``inner``, with an event before the first call
    and after each one on the call's stream, and each call's host stamps (``stamps``)."""

    def __init__(self, inner: BatchDriver, event: Callable[[], Any] = timing_event) -> None:
        self.inner, self._event = inner, event
        self.first: Any = None
        self.last: Any = None
        self.stamps = Stamps()

    def reset(self) -> None:
        self.first = self.last = None
        self.stamps = Stamps()

    def stream(self, views: Sequence[Any]) -> Any | None:
        return self.inner.stream(views)

    def pinned(self, hosts: Mapping[int, Any]) -> bool:
        return self.inner.pinned(hosts)

    def lane(self, stream: Any) -> Any:
        return self.inner.lane(stream)

    def join(self, stream: Any, lane: Any) -> None:
        self.inner.join(stream, lane)

    def copy(self, copies: Any, lo: int, hi: int, stream: Any) -> None:
        enter = time.perf_counter()  # before the first event, as the GPU lead ends at its record
        if self.first is None:
            self.first = self._event()
            self.first.record(stream)
        self.inner.copy(copies, lo, hi, stream)
        leave = time.perf_counter()
        self.last = self._event()
        self.last.record(stream)
        self.stamps.calls.append((enter, leave, True, copies, lo, hi))  # one direction per operation


def measure(op: Callable[[], Any], driver: RecordingDriver | None, sync: Callable[[], None], gbps: float,
            event: Callable[[], Any] = timing_event, current: Any = None) -> dict[str, float]:
    """One call of ``op`` taken apart (``COLUMNS``). ``driver``: the recorder the op's copies go
    through; None for a plain copy, whose span is timed by an event recorded after it (on
    ``current``, the stream its events go on: None for the current one). ``gbps``: the
    simulated copy engine's rate."""
    if driver is not None:
        driver.reset()
    start = event()
    sync()
    t0 = time.perf_counter()
    start.record(current)
    op()
    end = None
    if driver is None:
        end = event()
        end.record(current)
    sync()
    total = (time.perf_counter() - t0) * 1e6
    first, last = (start, end) if driver is None else (driver.first, driver.last)
    if first is None:  # nothing went through the driver (a fallback copied it): no attribution
        return dict.fromkeys(COLUMNS, float("nan")) | {"total us": total, "calls": 0}
    lead = start.elapsed_time(first) * 1e3
    span = first.elapsed_time(last) * 1e3
    calls = 0 if driver is None else len(driver.stamps.calls)
    idle = 0.0 if driver is None else driver.stamps.engines(True, gbps)[0] * 1e6
    host_lead = 0.0 if driver is None else (driver.stamps.calls[0][0] - t0) * 1e6
    return {"total us": total, "GPU lead us": lead, "host lead us": host_lead, "span us": span,
            "tail us": total - lead - span, "calls": calls, "idle us": idle}


def medians(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each column's median over ``samples``."""
    return {c: statistics.median(s[c] for s in samples) for c in COLUMNS}
