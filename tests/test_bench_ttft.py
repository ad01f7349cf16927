"""``kvdepot bench ttft`` on CPU with the tiny model: both modes load from kvdepot and stay exact."""

from __future__ import annotations

import pytest

from kvdepot.bench.ttft import add_arguments, run

pytestmark = pytest.mark.timeout(300)


def test_ttft_bench_in_process_and_through_a_server(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--model", "tiny", "--lengths", "256,512", "--miss-prompts", "2",
                              "--miss-length", "256", "--decode-tokens", "3", "--modes", "in-process,whole,mp",
                              "--json", str(tmp_path / "ttft.json")])
    result = run(args)
    hits = result["hits"]
    assert [(r["mode"], r["prompt"]) for r in hits] == [(m, n) for m in ("in-process", "whole", "mp") for n in (256, 512)]
    for row in hits:  # every hit is served by kvdepot (all but the last block) and exact
        assert row["tokens loaded"] == row["prompt"] - 32
        assert row["hit==device bitwise"] and row["tokens==recompute"]
        assert row["by layer"] is False  # a CPU pool always loads whole
        assert row["+64 partial hit ms"] > 0 and row["suffix only ms"] > 0  # (the bench checks what each loaded)
    assert [r["connector"] for r in result["misses"]] == [False, True]
    assert 0 < result["misses"][1]["connector host share"] < 1  # the connector's calls were timed
    assert (tmp_path / "ttft.json").exists()


def test_unknown_mode_is_refused():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="allowed: in-process, whole, mp"):
        run(parser.parse_args(["--device", "cpu", "--model", "tiny", "--modes", "gpu"]))
