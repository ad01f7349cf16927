"""Shared set-up for the TensorRT-LLM adapter tests: a fresh engine singleton per test."""

from __future__ import annotations

import pytest

from kvdepot.integrations.tensorrt_llm.utils import destroy_engine


@pytest.fixture(autouse=True)
def fresh_engine_singleton(monkeypatch: pytest.MonkeyPatch):
    for key in ("KVDEPOT_CONFIG_FILE", "KVDEPOT_CHUNK_SIZE", "KVDEPOT_HOST_CAPACITY_GB", "KVDEPOT_SAVE_DECODE_CACHE"):
        monkeypatch.delenv(key, raising=False)
    destroy_engine()
    yield
    destroy_engine()
