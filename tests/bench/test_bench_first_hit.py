"""``kvdepot bench firsthit`` on CPU: one order in this process; every hit whole and bit-exact."""

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


@pytest.mark.parametrize("order", first_hit.ORDERS)
def test_each_order_times_whole_bit_exact_hits_and_summarises_first_over_later(order, capsys):
    out = first_hit.run(_args("--order", order))
    assert [r["prompt"] for r in out["rows"]] == [0, 1, 2]
    assert all(r["order"] == order and r["hit==device bitwise"] for r in out["rows"])
    kinds = {(s["order"], s["hit"]) for s in out["summary"]}
    assert kinds == {(order, "kvdepot hit"), (order, "device hit")}
    for s in out["summary"]:
        assert s["first/later"] == pytest.approx(s["first ms"] / s["later median ms"])
    assert "first hit of a process" in capsys.readouterr().out
