"""Shared set-up for the TensorRT-LLM adapter tests: a fresh engine singleton per test."""

from __future__ import annotations

import pytest

from kvdepot.integrations.tensorrt_llm.providers import destroy_engine


@pytest.fixture(autouse=True)
def fresh_engine_singleton(kvdepot_env_cleared: None):
    destroy_engine()
    yield
    destroy_engine()
