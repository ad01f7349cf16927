"""``kvdepot bench contexts``: its options refused with the option named, a clear exit without
CUDA, and on a GPU every row measured with the other process's bytes checked where they landed."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvdepot.bench import cross_context


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cross_context.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "named", "allowed"), [
    (["--layer-mib", "64,x"], "--layer-mib", ">= 1"), (["--layers", "0"], "--layers", ">= 1"),
    (["--rounds", "-1"], "--rounds", ">= 1"), (["--compute-per-copy", "0"], "--compute-per-copy", "0.1 to 10"),
    (["--compute-per-copy", "fast"], "--compute-per-copy", "0.1 to 10")])
def test_bad_options_are_refused_naming_the_option(argv, named, allowed, capsys):
    with pytest.raises(SystemExit):
        _args(*argv)
    err = capsys.readouterr().err
    assert f"argument {named}:" in err and allowed in err


def test_the_pattern_is_the_same_for_a_seed_and_differs_between_seeds():
    shape, cpu = torch.Size((2, 4096)), torch.device("cpu")
    assert torch.equal(cross_context._pattern(shape, 1, cpu), cross_context._pattern(shape, 1, cpu))
    assert not torch.equal(cross_context._pattern(shape, 1, cpu), cross_context._pattern(shape, 2, cpu))
    assert all(torch.equal(a, b) for a, b in zip(cross_context._layers(shape, 2, cpu), cross_context._pattern(shape, 2, cpu),
                                                  strict=True))


def test_without_cuda_it_says_what_it_needs():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu test below runs the bench")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cross_context.run(_args("--layers", "2"))


@pytest.mark.gpu
def test_every_mode_is_measured_once_per_size():
    rows = cross_context.run(_args("--layers", "4", "--layer-mib", "8", "--rounds", "2"))
    assert [r["mode"] for r in rows] == list(cross_context.MODES)
    assert rows[0]["over device hit"] == 1.0
    assert all(r["forward ms"] > 0 and r["matmuls per layer"] >= 1 for r in rows)
