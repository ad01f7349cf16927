"""``LoadGate``: a lower-tier hit is promised only when reading it is expected to beat recomputing
it, with both rates measured at run time (a fake clock here); unmeasured or off: always promised."""

from __future__ import annotations

import pytest

from kvdepot.integrations.load_gate import LoadGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def steps(gate: LoadGate, clock: Clock, *timed: tuple[int, float]) -> None:
    """Steps of ``tokens`` that each take ``seconds`` (the time until the next step)."""
    for tokens, seconds in timed:
        gate.step(tokens)
        clock.now += seconds
    gate.step(0)


def test_unmeasured_rates_keep_promising() -> None:
    clock = Clock()
    gate = LoadGate(True, 1024, clock)
    assert gate.worth_loading(8192, 100.0)  # no prefill seen yet
    steps(gate, clock, (8192, 0.25))
    assert gate.recompute_tokens_per_s == pytest.approx(8192 / 0.25)
    assert gate.worth_loading(8192, None)  # no promotion finished yet
    assert gate.refused == 0


def test_a_read_slower_than_recompute_is_not_promised() -> None:
    clock = Clock()
    gate = LoadGate(True, 1024, clock)
    steps(gate, clock, (8192, 0.283))  # the H200's 8K prefill of an 8B model: ~29K tokens/s
    redis_one_server = 1.3e9 / 131072  # 1.3 GB/s at 128 KiB per token: ~9.9K tokens/s
    assert not gate.worth_loading(8192, redis_one_server)
    assert gate.worth_loading(8192, 4 * 29000.0)  # a read four times faster than recompute
    assert gate.worth_loading(0, redis_one_server)  # nothing below host memory: nothing to decide
    assert gate.refused == 1


def test_decode_steps_and_idle_gaps_say_nothing_about_prefill() -> None:
    clock = Clock()
    gate = LoadGate(True, 1024, clock)
    steps(gate, clock, *[(8, 0.02)] * 10)  # decode: 400 tokens/s, not a prefill rate
    assert gate.recompute_tokens_per_s is None
    steps(gate, clock, (4096, 0.1))
    steps(gate, clock, (4096, 30.0))  # then nothing for 30 s: the engine was idle, not slow
    assert gate.recompute_tokens_per_s == pytest.approx(4096 / 0.1)
    steps(gate, clock, (4096, 0.3))  # three times slower: a busier engine, taken in
    assert 4096 / 0.3 < gate.recompute_tokens_per_s < 4096 / 0.1


def test_the_estimate_follows_a_changed_engine() -> None:
    clock = Clock()
    gate = LoadGate(True, 1024, clock)
    steps(gate, clock, *[(8192, 0.25)] * 3)
    assert not gate.worth_loading(8192, 20000.0)
    steps(gate, clock, *[(8192, 0.8)] * 6)  # the engine slowed down (contention): now reads win
    assert gate.worth_loading(8192, 20000.0)


def test_off_always_promises() -> None:
    clock = Clock()
    gate = LoadGate(False, 1024, clock)
    steps(gate, clock, (8192, 0.001))
    assert gate.worth_loading(8192, 1.0) and gate.refused == 0
