"""``bench.call_anatomy``: a call taken apart by its events and stamps, checked on the CPU with a
fake clock that the host's "work" and the driver's calls advance, and events stamped by it."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.bench import call_anatomy
from kvdepot.transfer.plan import CopyList


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(call_anatomy.time, "perf_counter", clock)
    return clock


class ClockEvent:
    """A timing event stamped by the fake clock when recorded (a GPU's when its stream reaches it)."""

    clock: Clock

    def __init__(self) -> None:
        self.at: float | None = None
        self.streams: list = []

    def record(self, stream=None) -> None:
        self.at = self.clock()
        self.streams.append(stream)

    def elapsed_time(self, other: ClockEvent) -> float:  # ms, as torch's
        return (other.at - self.at) * 1e3


class SlowDriver:
    """Each call takes ``call_s``; everything else answers as a pinned CUDA stream would."""

    def __init__(self, call_s: float, clock: Clock) -> None:
        self.call_s, self.calls, self.clock = call_s, 0, clock

    def stream(self, views):
        return "stream"

    def pinned(self, hosts):
        return True

    def lane(self, stream):
        return "lane"

    def join(self, stream, lane):
        pass

    def copy(self, copies, lo, hi, stream):
        self.calls += 1
        self.clock.sleep(self.call_s)


def test_a_call_is_split_into_lead_span_and_tail_and_its_idle_is_simulated(clock):
    ClockEvent.clock = clock
    recorder = call_anatomy.RecordingDriver(SlowDriver(0.002, clock), event=ClockEvent)
    listing = CopyList(np.array([[0, 0], [0, 0], [10**6, 10**6]], dtype=np.int64))  # 1 MB per copy

    def op() -> None:
        clock.sleep(0.010)  # the host's work before the first window
        recorder.copy(listing, 0, 1, "stream")
        clock.sleep(0.005)  # a gap the copies (1 MB at 1 GB/s: 1 ms) do not cover
        recorder.copy(listing, 1, 2, "stream")
        clock.sleep(0.003)  # after the last window: the tail

    row = call_anatomy.measure(op, recorder, sync=lambda: None, gbps=1.0, event=ClockEvent)
    assert row["calls"] == 2 and recorder.inner.calls == 2
    assert row["GPU lead us"] == pytest.approx(10_000) and row["host lead us"] == pytest.approx(10_000)
    assert row["span us"] == pytest.approx(2_000 + 5_000 + 2_000)  # first call, gap, second call
    assert row["tail us"] == pytest.approx(3_000)
    assert row["total us"] == pytest.approx(10_000 + 5_000 + 3_000 + 2 * 2_000)
    # The first call's copy ran 12-13 ms; the second call returned at 19 ms: 6 ms dry.
    assert row["idle us"] == pytest.approx(6_000)
    assert recorder.first.streams == ["stream"] and recorder.last.streams == ["stream"]
    recorder.reset()
    assert recorder.first is None and not recorder.stamps.calls


def test_a_plain_copy_is_its_own_span_and_a_call_without_driver_calls_is_not_attributed(clock):
    ClockEvent.clock = clock
    row = call_anatomy.measure(lambda: clock.sleep(0.004), None, sync=lambda: None, gbps=1.0, event=ClockEvent)
    assert row["GPU lead us"] == 0 and row["host lead us"] == 0 and row["calls"] == 0 and row["idle us"] == 0
    assert row["span us"] == pytest.approx(4_000) and row["tail us"] == 0
    recorder = call_anatomy.RecordingDriver(SlowDriver(0, clock), event=ClockEvent)
    row = call_anatomy.measure(lambda: None, recorder, sync=lambda: None, gbps=1.0, event=ClockEvent)
    assert row["calls"] == 0 and row["total us"] == 0 and np.isnan(row["span us"])  # the clock did not move


def test_medians_take_each_column_over_the_samples():
    rows = [dict.fromkeys(call_anatomy.COLUMNS, float(v)) for v in (3, 1, 2)]
    assert call_anatomy.medians(rows) == dict.fromkeys(call_anatomy.COLUMNS, 2.0)
