"""``kvdepot bench hooks`` on CPU, small: every mode runs against the simulated server, and server
mode with the progress page follows its loads without a LAYERS call where LAYERS alone needs some."""

from __future__ import annotations

import argparse

import pytest

from kvdepot.bench.layer_hooks import add_arguments, run
from kvdepot.server.progress_page import PAGE_SUPPORTED

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not PAGE_SUPPORTED, reason="the page is x86-64 only")]


def test_hooks_bench_rows(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rows = run(parser.parse_args(["--layers", "6", "--issue-us", "300", "--gil-us", "50", "--forward-us", "50",
                                  "--loads", "2", "--rounds", "1", "--json", str(tmp_path / "hooks.json")]))
    by_mode = {row["mode"]: row for row in rows}
    assert list(by_mode) == ["in-process", "in-process-hooks", "mp-rpc", "mp-page"]
    assert by_mode["in-process-hooks"]["LAYERS/load"] == 0
    assert by_mode["in-process"]["LAYERS/load"] == 0 and by_mode["in-process"]["forward/in-process"] == 1.0
    assert by_mode["mp-rpc"]["LAYERS/load"] >= 1  # one call ahead from the reply on, at least
    assert by_mode["mp-page"]["LAYERS/load"] == 0
    assert all(row["forward ms"] > 0 and row["issue us/layer"] > 0 for row in rows)
    assert (tmp_path / "hooks.json").exists()


@pytest.mark.parametrize("launches", ["-1", "two"])
def test_a_bad_launch_count_names_the_option(launches: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--launches", launches])
    assert f"--launches: {launches!r} is not a whole number >= 0" in capsys.readouterr().err
    assert parser.parse_args(["--launches", "0"]).launches == 0


def test_unknown_mode_is_refused():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="not among in-process, in-process-hooks, mp-rpc, mp-page"):
        run(parser.parse_args(["--modes", "gpu"]))
