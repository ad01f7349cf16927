"""Shared set-up of the vLLM tests: a tiny model made here, a fresh engine singleton per test."""

from __future__ import annotations

import pytest

from kvdepot.integrations.vllm.layout import destroy_engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (hidden 128, vocab 1000, 4096 positions) saved by transformers."""
    from kvdepot.integrations.vllm.bench import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(autouse=True)
def fresh_vllm_engine_singleton(kvdepot_env_cleared: None):
    destroy_engine()
    yield
    destroy_engine()
