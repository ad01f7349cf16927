"""``kvdepot bench firsthit`` on CPU: one order and warm-up in this process; every hit whole and bit-exact."""

from __future__ import annotations

import argparse

import pytest

from kvdepot.bench import first_hit


@pytest.fixture(autouse=True)
def _fresh_singleton(kvdepot_env_cleared: None):
    from kvdepot.integrations.tensorrt_llm.providers import destroy_engine

    destroy_engine()
    yield
    destroy_engine()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    first_hit.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--model", "tiny", "--length", "600", "--hits", "3", *argv])


@pytest.mark.parametrize("warmup", first_hit.WARMUPS)
@pytest.mark.parametrize("order", first_hit.ORDERS)
def test_each_order_times_whole_bit_exact_hits_and_summarises_first_over_later(order, warmup, capsys, monkeypatch):
    from kvdepot.runtime import Engine

    warmed, real = [], Engine.warm_up
    monkeypatch.setattr(Engine, "warm_up", lambda self: (warmed.append(1), real(self)))
    out = first_hit.run(_args("--order", order, "--warmup", warmup))
    assert warmed == ([1] if warmup == "on" else [])  # asked for on CPU too, where the default is off
    assert [r["prompt"] for r in out["rows"]] == [0, 1, 2]
    assert all(r["order"] == order and r["warm-up"] == warmup and r["hit==device bitwise"] for r in out["rows"])
    kinds = {(s["warm-up"], s["order"], s["hit"]) for s in out["summary"]}
    assert kinds == {(warmup, order, "kvdepot hit"), (warmup, order, "device hit")}
    for s in out["summary"]:
        assert s["first/later"] == pytest.approx(s["first ms"] / s["later median ms"])
    assert "first hit of a process" in capsys.readouterr().out


def test_a_bad_warmup_names_the_option_and_its_choices(capsys):
    with pytest.raises(SystemExit):
        _args("--warmup", "sometimes")
    err = capsys.readouterr().err
    assert "--warmup" in err and "'on', 'off', 'both'" in err


def test_the_summary_takes_each_processes_first_over_its_later_hits_then_the_median_over_processes():
    """Three processes of one order: each ratio is its own process's first over its later hits'
    median (a process's hits are never mixed with another's); the row gives their median and range."""
    hits = {0: [10.0, 5.0, 5.0], 1: [12.0, 6.0, 8.0], 2: [9.0, 9.0, 9.0]}  # ratios 2.0, 12/7, 1.0
    rows = [{"warm-up": "on", "order": "kvdepot-first", "process": p, "prompt": i, "kvdepot hit ms": ms,
             "device hit ms": 1.0} for p, run in hits.items() for i, ms in enumerate(run)]
    by_kind = {s["hit"]: s for s in first_hit._summary(rows)}
    assert set(by_kind) == {"kvdepot hit", "device hit"}
    s = by_kind["kvdepot hit"]
    assert (s["processes"], s["min"], s["max"]) == (3, 1.0, 2.0)
    assert s["first/later"] == pytest.approx(12 / 7)
    assert (s["first ms"], s["later median ms"]) == (10.0, 7.0)
    assert by_kind["device hit"]["first/later"] == 1.0


def test_processes_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        _args("--processes", "0")
    assert "--processes: '0' is not a whole number >= 1" in capsys.readouterr().err


def test_several_processes_each_give_their_own_first_hit():
    out = first_hit.run(_args("--order", "kvdepot-first", "--warmup", "on", "--processes", "2"))
    assert [(r["process"], r["prompt"]) for r in out["rows"]] == [(p, i) for p in (0, 1) for i in range(3)]
    assert all(r["hit==device bitwise"] for r in out["rows"])
    assert {s["processes"] for s in out["summary"]} == {2}
