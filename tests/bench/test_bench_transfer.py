"""``kvdepot bench transfer``, ``bench bookkeeping`` and ``bench dma``: every row measured, the
batch mover's variants each measured in one run, and the bookkeeping bench's stamps in order."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import numpy as np
import pytest
import torch

from kvdepot.bench import bookkeeping, dma_ceiling, transfer
from kvdepot.bench.common import HostSteal, host_python_us, paired_seconds
from kvdepot.transfer.plan import CopyList


def _args(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_transfer_measures_each_batch_variant_in_one_run(kvdepot_env_cleared, capsys):
    rows = transfer.run(_args(transfer, "--device", "cpu", "--mover", "batch", "--tokens", "256", "--reps", "2", "--layers", "2",
                              "--store-head-mib", "0,4", "--lanes", "1,2"))
    movers = ["batch head 0 lanes 1", "batch head 0 lanes 2", "batch head 4 lanes 1", "batch head 4 lanes 2"]
    assert [r["mover"] for r in rows] == [m for m in movers for _ in range(4)]
    assert [r["op"] for r in rows[:4]] == ["store", "2 stores at once", "retrieve", "lookup + retrieve"]
    assert all(r["ratio"] > 0 and r["call us"] > 0 for r in rows)
    assert all(r["steal ms/s"] >= 0 for r in rows)  # this machine's kernel says (NaN would fail)
    out = capsys.readouterr().out
    assert re.search(r"kvdepot bench transfer — cpu; host Python \d+ us per reference loop", out)
    # Where each variant's threads, arena and memcpy buffer sit (the store's spread, issue 19).
    assert len(re.findall(r"^NUMA batch head \d lanes \d: CPUs .*; arena pages .*; memcpy pages ", out, re.M)) == 4


def test_the_host_python_figure_follows_the_speed_of_python():
    """Python slowed by a trace function (every line reported) reads as a slower host."""
    def tracer(frame, event, arg):  # called for every line of every frame
        return tracer

    plain, before = host_python_us(), sys.gettrace()
    sys.settrace(tracer)
    try:
        traced = host_python_us()
    finally:
        sys.settrace(before)
    assert traced > 1.5 * plain > 0


def test_host_steal_reads_the_hypervisors_take_per_second(tmp_path, monkeypatch):
    """The steal field is the eighth after "cpu", in clock ticks; the figure is ms per wall second."""
    stat = tmp_path / "stat"
    monkeypatch.setattr(HostSteal, "STAT", str(stat))
    clock = iter([10.0, 12.0, 13.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  1 2 3 4 5 6 7 {tick} 0 0\ncpu0 9 9 9 9 9 9 9 9 0 0\n")
    steal = HostSteal()
    stat.write_text(f"cpu  1 2 3 4 5 6 7 {3 * tick} 0 0\n")
    assert steal.ms_per_s() == pytest.approx(1000.0)  # 2 s stolen over 2 s
    stat.write_text("intr 5\n")  # a kernel that does not say: no figure, not a zero
    assert steal.ms_per_s() is None


def test_bench_transfer_anatomy_is_cuda_only_and_leaves_the_rows_alone_on_cpu(kvdepot_env_cleared):
    rows = transfer.run(_args(transfer, "--device", "cpu", "--mover", "batch", "--tokens", "256", "--reps", "2", "--layers", "2",
                              "--anatomy"))
    assert [r["op"] for r in rows] == ["store", "2 stores at once", "retrieve", "lookup + retrieve"]


@pytest.mark.gpu
def test_bench_transfer_anatomy_takes_a_store_and_a_retrieve_apart_beside_memcpy(kvdepot_env_cleared):
    from kvdepot.transfer import cuda_batch

    if not cuda_batch.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync_v2")
    rows = transfer.run(_args(transfer, "--device", "cuda", "--mover", "batch", "--blocks", "64", "--reps", "3",
                              "--layers", "4", "--tokens-per-block", "8", "--anatomy"))
    parts = {r["op"]: r for r in rows if "total us" in r}
    assert set(parts) == {"store", "memcpy d2h", "retrieve", "memcpy h2d"}
    for op, r in parts.items():
        assert r["span us"] > 0 and r["GPU lead us"] >= 0 and r["idle us"] >= 0
        assert r["total us"] == pytest.approx(r["GPU lead us"] + r["span us"] + r["tail us"], rel=0.2)  # medians each
        assert (r["calls"] >= 1) == (op in ("store", "retrieve"))
    assert parts["store"]["GPU lead us"] > 0  # the engine's host work comes before its first window


@pytest.mark.gpu
def test_bench_transfer_times_a_store_and_a_retrieve_behind_gpu_work(kvdepot_env_cleared):
    """The rows an engine's call order gives (the forward still running when its store is called):
    each operation's time runs from the work's end, against a memcpy called the same way."""
    from kvdepot.bench.common import behind_work_seconds

    rows = transfer.run(_args(transfer, "--device", "cuda", "--mover", "batch", "--blocks", "64", "--reps", "3",
                              "--layers", "4", "--tokens-per-block", "8", "--behind-ms", "1"))
    behind = {r["op"]: r for r in rows if "behind" in r["op"]}
    assert set(behind) == {"store behind 1 ms of work", "retrieve behind 1 ms of work"}
    assert all(r["ratio"] > 0 and r["GB/s"] > 0 for r in behind.values())
    compute = {r["op"]: r["ratio"] for r in rows if r["op"].startswith("compute beside")}  # paired with the loop alone
    assert set(compute) == {"compute beside store", "compute beside memcpy"} and all(v > 0 for v in compute.values())
    # The clock starts where the work ends: 5 ms of work before a no-op reads as (almost) nothing.
    device = torch.device("cuda")
    nothing_s, _, _ = behind_work_seconds(lambda: None, lambda: None, device, reps=3, work_s=0.005)
    assert nothing_s < 0.001


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_behind_ms_names_the_option(value, capsys):
    with pytest.raises(SystemExit):
        _args(transfer, "--behind-ms", value)
    assert f"--behind-ms: '{value}' is not a number of milliseconds >= 0" in capsys.readouterr().err


def test_what_runs_before_an_operation_is_off_its_clock():
    """``paired_seconds(before=...)``: a load's lookup (the scheduler's call) runs ahead of each timed
    load, every time, and none of its time is counted."""
    ran = []
    op_s, _, _ = paired_seconds(lambda: ran.append("op"), lambda: None, torch.device("cpu"), reps=3,
                                before=lambda: (ran.append("before"), time.sleep(0.05)))
    assert ran == ["before", "op"] * 4  # the warm-up pair and three timed ones
    assert op_s < 0.01


@pytest.mark.parametrize("sweep, driver_us", [("0", "0"), ("4", "0"), ("0", "0.5")])
def test_bench_bookkeeping_times_each_shape_and_path(sweep, driver_us):
    """``--sweep-mib``: the caches swept before each timed operation, as a GPU's DMA does;
    ``--driver-us-per-copy``: the stubbed driver's time, which its column reports as it came out."""
    rows = bookkeeping.run(_args(bookkeeping, "--models", "1b", "--tokens-per-block", "8", "--reps", "3",
                                 "--blocks", "64", "--driver-us-per-copy", driver_us, "--sweep-mib", sweep))
    assert {(r["path"], r["op"]) for r in rows} == {
        ("bookkeeping", "store"), ("bookkeeping", "lookup"), ("bookkeeping", "lookup+lease"), ("bookkeeping", "retrieve"),
        ("batch", "store"), ("batch", "retrieve"), ("batch", "both: store"), ("batch", "both: retrieve")}
    for r in rows:
        assert r["call us"] > 0
        if r["path"] == "batch":  # a copy was issued after the call began, and all of it by the end
            assert 0 < r["first copy us"] <= r["all issued us"]
            assert 0 <= r["longest gap us"] < r["all issued us"] - r["first copy us"]
            assert r["engines idle us"] >= 0 and r["copies end us"] > r["first copy us"]
            assert r["driver us/copy"] > (0.5 if driver_us != "0" else 0)  # at least the memset asked for
        else:
            assert math.isnan(r["first copy us"]) and math.isnan(r["longest gap us"])
            assert math.isnan(r["driver us/copy"])


def _calls(*spans: tuple[float, float, bool], nbytes: int = 0) -> list[tuple]:
    """Stamped calls of ``nbytes`` each (one copy of that size)."""
    listing = CopyList(np.array([[0], [0], [nbytes]], dtype=np.int64))
    return [(enter, leave, to_host, listing, 0, 1) for enter, leave, to_host in spans]


def test_the_longest_gap_is_between_calls_of_one_direction_with_none_in_the_driver():
    stamps = bookkeeping.Stamps(_calls((0.0, 1.0, True), (0.5, 3.0, True), (2.0, 2.5, False), (7.0, 8.0, True),
                                       (4.0, 4.5, True), (9.5, 10.0, False)))
    assert stamps.longest_gap(True) == 2.5  # 4.5 -> 7.0; 1.0 -> 4.0 is covered by the call to 3.0
    assert stamps.longest_gap(False) == 7.0


def test_the_simulated_engine_runs_dry_only_where_the_calls_fall_behind_its_copies():
    # 2 GB of copies per call at 1 GB/s: 2 s each, from when the call returned, after the ones before.
    stamps = bookkeeping.Stamps(_calls((0.0, 1.0, True), (1.5, 2.0, True), (5.5, 6.0, True), (0.0, 9.0, False),
                                       nbytes=2 * 10**9))
    idle, end = stamps.engines(True, 1.0)
    assert (idle, end) == (1.0, 8.0)  # 1-3, 3-5 busy; dry 5-6; 6-8
    assert stamps.engines(False, 1.0) == (0.0, 11.0)


@pytest.mark.parametrize(("argv", "named"), [(["--block-kib", "256,x"], "--block-kib"), (["--block-kib", "0"], "--block-kib"),
                                             (["--blocks", "0"], "--blocks"), (["--reps", "-3"], "--reps")])
def test_bench_dma_refuses_bad_sizes_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit):
        _args(dma_ceiling, *argv)
    err = capsys.readouterr().err
    assert f"argument {named}:" in err and ">= 1" in err  # the option and what it allows, in one line


def test_bench_dma_says_what_it_needs_without_a_cuda_driver():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu test below runs the bench")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        dma_ceiling.run(_args(dma_ceiling, "--blocks", "8"))


@pytest.mark.gpu
def test_bench_dma_measures_every_row_against_memcpy():
    from kvdepot.transfer import cuda_batch

    if not cuda_batch.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync_v2")
    rows = dma_ceiling.run(_args(dma_ceiling, "--block-kib", "256", "--blocks", "16", "--reps", "3"))
    assert [r["op"] for r in rows] == ["store", "retrieve", "both", "store, engines only", "retrieve, engines only"]
    assert all(0 < r["ratio"] < 2 for r in rows)
    assert all(r["driver us"] > 0 for r in rows[3:])


def test_a_pair_can_be_timed_by_another_clock():
    """``paired_seconds(clock=...)``: every timed call goes through the clock (``behind_work_seconds``
    times by CUDA events there), the warm-up does not, and the ratio pairs what it returned."""
    seen = []

    def clock(fn):
        fn()
        seen.append(fn)
        return 2.0 if fn is op else 1.0

    def op():
        pass

    def ceiling():
        pass

    assert paired_seconds(op, ceiling, torch.device("cpu"), reps=3, clock=clock) == (2.0, 1.0, 0.5)
    assert seen == [op, ceiling] * 3
