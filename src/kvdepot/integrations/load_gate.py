"""Whether a hit found only on disk/Redis is worth waiting for, or faster to recompute.

    gate = LoadGate(enabled, min_step_tokens, clock)  or  LoadGate.from_config(config)
    gate.step(tokens)                     every scheduler step: the tokens it scheduled
    gate.worth_loading(tokens, read_tps)  promise ``tokens`` tokens read from below host memory?
    gate.exclude(seconds)                 time this step spent waiting for a read, not computing
    gate.recompute_tokens_per_s           the engine's measured prefill rate (None until measured)

With ``lower_tier_hits: load`` the request that found a lower-tier hit waits until the hit is
read into host memory (TensorRT-LLM: its lookup waits; vLLM: the request is parked). That is only a gain when the read is faster than computing the same
tokens: on the H200 an 8K-token prompt of an 8B model (1 GiB of KV) recomputes in 283 ms, and one
Redis server delivers ~1.3 GB/s (~0.8 s). So the connector promises the lower-tier part only when

    tokens / read rate  <  tokens / recompute rate

with both rates measured at run time: the read rate by the engine, from its finished promotions
(``Hit.read_tokens_per_s``: prefetches count too, so the gate learns while it says no), and the
recompute rate here, from the steps the connector sees — a step's scheduled tokens over the time
until the next step, for steps of at least ``min_step_tokens`` (prefill-heavy ones: a decode step
says nothing about prefill). A step more than ``_SLOW`` times slower than the estimate is taken for
an idle gap and dropped. Until both rates are measured, and with ``enabled`` off (config
``lower_tier_gate``), every lower-tier hit is promised, as before. A hit not promised is still
promoted: it serves the next request with the same prefix from host memory.

Both sides are linear in the tokens, so for a given deployment the answer rarely depends on the
hit's size; it changes when the tier or the engine speeds up or slows down (a loaded Redis, a
busier GPU, a Redis Cluster with more masters).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvdepot.config import DepotConfig
from kvdepot.storage.rate import Rate

_SLOW = 4.0  # a step this many times slower than the estimate is an idle gap, not compute


class LoadGate:
    def __init__(self, enabled: bool, min_step_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled, self._min, self._clock = enabled, max(1, min_step_tokens), clock
        self._recompute = Rate()
        self._last: tuple[float, int] | None = None  # the previous step: when, and its tokens
        self.refused = 0  # lower-tier hits not promised (recomputing was expected to be faster)

    @classmethod
    def from_config(cls, config: DepotConfig) -> LoadGate:
        """The connectors' gate: ``lower_tier_gate``, and prefill measured from steps of at least
        four chunks (a decode step says nothing about prefill)."""
        return cls(config.lower_tier_gate, 4 * config.chunk_size)

    @property
    def recompute_tokens_per_s(self) -> float | None:
        return self._recompute.per_second

    def step(self, tokens: int) -> None:
        """A scheduler step scheduled ``tokens`` tokens; the previous step took until now."""
        now = self._clock()
        if self._last is not None:
            then, scheduled = self._last
            took, rate = now - then, self._recompute.per_second
            if scheduled >= self._min and (rate is None or took * rate <= _SLOW * scheduled):
                self._recompute.add(scheduled, took)
        self._last = (now, tokens)

    def exclude(self, seconds: float) -> None:
        """The current step spent ``seconds`` waiting for a lower tier (TensorRT-LLM's lookup reads
        before it promises): not compute, so the step's time leaves them out."""
        if self._last is not None:
            self._last = (self._last[0] + seconds, self._last[1])

    def worth_loading(self, tokens: int, read_tokens_per_s: float | None) -> bool:
        """Promise ``tokens`` tokens below host memory, read at ``read_tokens_per_s``?"""
        recompute = self._recompute.per_second
        if not self.enabled or tokens <= 0 or read_tokens_per_s is None or recompute is None:
            return True
        if read_tokens_per_s > recompute:
            return True
        self.refused += 1
        return False
