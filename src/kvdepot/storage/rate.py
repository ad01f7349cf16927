"""A throughput measured at run time: units per second from samples (units, seconds).

    rate = Rate()
    rate.add(units, seconds)     one finished piece of work (a promotion's bytes, a step's tokens)
    rate.per_second -> float | None   None until a sample came

Both sums decay by ``keep`` per sample, so the estimate follows a tier or an engine whose speed
changes (a loaded Redis, a busier GPU) within a few samples, and one outlier moves it only part of
the way. A ratio of decayed sums, not a mean of per-sample rates: a large sample weighs more than
a small one, whose time is mostly fixed costs (a round trip, a step's launch). Thread-safe: the
tiers' threads add, a scheduler reads.
"""

from __future__ import annotations

import threading


class Rate:
    def __init__(self, keep: float = 0.7) -> None:
        if not 0 <= keep < 1:
            raise ValueError(f"keep must be in [0, 1), got {keep}")
        self._keep = keep
        self._units = self._seconds = 0.0
        self._lock = threading.Lock()

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return  # nothing moved, or a clock that did not advance: no information
        with self._lock:
            self._units = self._keep * self._units + units
            self._seconds = self._keep * self._seconds + seconds

    @property
    def per_second(self) -> float | None:
        with self._lock:
            return self._units / self._seconds if self._seconds > 0 else None
