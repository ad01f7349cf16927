"""Shared set-up of the vLLM tests: a tiny model made here, a fresh engine singleton per test, and
vLLM alone over the end-to-end prompts, started once for every end-to-end module."""

from __future__ import annotations

from typing import Any

import pytest

from kvdepot.integrations.vllm.providers import destroy_engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (hidden 128, vocab 1000, 4096 positions) saved by transformers."""
    from kvdepot.bench.vllm import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


class Pending:
    """A child started now, its results read once on first use."""

    def __init__(self, child: Any) -> None:
        self._child, self._result = child, None

    def results(self) -> list[dict[str, Any]]:
        if self._result is None:
            self._result = self._child.result(timeout_s=400)
        return self._result["results"]


@pytest.fixture(scope="session")
def vllm_alone(tiny_model: str) -> Pending:
    """vLLM without a connector over [A, B] (vllm_helpers.prompts): the outputs to match.

    Started when first requested and read when first needed, so a module can start its own
    vLLM beside it."""
    from vllm_helpers import COMMON, prompts

    from kvdepot.bench.vllm import Child

    return Pending(Child({**COMMON, "model": tiny_model, "prompts": list(prompts())}))


@pytest.fixture(autouse=True)
def fresh_vllm_engine_singleton(kvdepot_env_cleared: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("KVDEPOT_SERVER_URL", raising=False)  # it would put the connector in server mode
    destroy_engine()
    yield
    destroy_engine()
