"""``kvdepot bench ttft --model`` takes the MLA and FP8 shapes: their hits are exact there too."""

from __future__ import annotations

import argparse

import pytest

from kvdepot.bench.ttft import add_arguments, run

pytestmark = pytest.mark.timeout(300)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mla-tiny", "tiny-fp8"])
def test_ttft_bench_runs_the_new_shapes(model, kvdepot_env_cleared):
    args = _parser().parse_args(["--device", "cpu", "--model", model, "--lengths", "256", "--miss-prompts", "1",
                                 "--miss-length", "128", "--decode-tokens", "2", "--modes", "in-process,mp"])
    hits = run(args)["hits"]
    assert [r["mode"] for r in hits] == ["in-process", "mp"]
    for row in hits:
        assert row["tokens loaded"] == 256 - 32 and row["hit==device bitwise"] and row["tokens==recompute"]


def test_model_choices_are_listed_and_a_wrong_one_is_refused(capsys):
    help_text = _parser().format_help()
    for name in ("mla-v2-lite", "llama-8b-fp8", "llama-8b"):
        assert name in help_text
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "llama-9b"])
    assert "--model 'llama-9b': not a preset (" in capsys.readouterr().err
