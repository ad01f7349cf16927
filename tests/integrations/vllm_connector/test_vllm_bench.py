"""``kvdepot bench vllm`` (moved from integrations/vllm/bench.py): three real vLLM engines on the
tiny model, a row each, the connector's second request a kvdepot hit, the JSON written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvdepot.bench import vllm as bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_bench_vllm_rows(tiny_model: str, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", tiny_model, "--prompt-tokens", "600", "--repeats", "1",
                              "--json", str(tmp_path / "vllm.json")])
    rows = bench.run(args)
    assert [r["engine"].split()[0] for r in rows] == ["vLLM", "+", "vLLM"]
    alone, kvdepot, prefix = rows
    assert alone["cached tokens"] == 0  # no prefix cache, no connector
    assert kvdepot["cached tokens"] >= 512  # two 256-token chunks served by kvdepot
    assert prefix["cached tokens"] > 0
    assert all(r["TTFT ms"] > 0 and r["first request ms"] > 0 for r in rows)
    assert json.loads((tmp_path / "vllm.json").read_text())["tables"][0]["rows"] == rows
