"""kvdepot hits on the MLA and FP8 models equal device hits byte for byte, in-process and in server mode.

One engine, one prompt A of 321 tokens (320 = 10 blocks = 5 chunks reusable): a miss saves it, a
filler evicts it from the engine's pool, A again loads its 320 tokens from kvdepot, and A once more
finds them on the device. The loaded blocks must hold the miss's bytes exactly, and the kvdepot hit
must give the device hit's logits bit for bit (the same forward over the same KV). Server mode
talks to a ``kvdepot server`` subprocess (a bytes pool on CPU, CUDA IPC on a GPU).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvdepot.bench.server_proc import running_server
from kvdepot.integrations.tensorrt_llm import mp_adapter, providers
from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
)
from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

TPB, CHUNK, POOL_TOKENS, NEW = 32, 64, 352, 4
MODELS = ["mla-tiny", "tiny-fp8", "mla-tiny-fp8"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def server_url():
    """One ``python -m kvdepot.server`` for the module; each model gets its own namespace."""
    with running_server("--chunk-size", str(CHUNK), "--host-capacity-gb", "0.2") as url:
        yield url


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i * i + 3 * i) % 509 + 1 for i in range(n)]


def _recording(scheduler: type, worker: type, blocks: dict[int, list[int]]) -> tuple[type, type]:
    class Recording(scheduler):  # type: ignore[misc, valid-type]
        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
            blocks[request.py_request_id] = list(block_ids)
            super().update_state_after_alloc(request, block_ids)

    return Recording, worker


def _model(name: str) -> Any:
    from kvdepot.runtime.mla import MLA_PRESETS

    if name == "mla-tiny-fp8":
        return replace(MLA_PRESETS["mla-tiny"], kv_dtype=torch.float8_e4m3fn, kv_scale=1 / 16)
    return name


def _scenario(model: str, device: str, connector: tuple[type, type], ready: Any = None) -> None:
    blocks: dict[int, list[int]] = {}
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=POOL_TOKENS),
                            model=f"{model}-hits")
    eng = Engine(_model(model), device=device, llm_args=llm_args, connector=_recording(*connector, blocks), seed=0)
    if ready is not None:
        ready()
    a, filler = _prompt(321, 1), _prompt(POOL_TOKENS - NEW + 1, 2)
    miss = eng.generate([a], NEW)[0]
    saved = eng.pool[blocks[miss.request_id][:10]].view(torch.uint8).clone()
    eng.generate([filler], NEW)
    hit = eng.generate([a], NEW)[0]
    device = eng.generate([a], NEW)[0]
    assert hit.num_device_reused_tokens == 0 and hit.num_connector_matched_tokens == 320
    assert device.num_device_reused_tokens == 320 and device.num_connector_matched_tokens == 0
    loaded = blocks[hit.request_id][:10]
    assert torch.equal(eng.pool[loaded].view(torch.uint8), saved)
    assert hit.output_ids == device.output_ids == miss.output_ids
    assert all(torch.equal(x, y) for x, y in zip(hit.logits, device.logits, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_in_process_hit_is_the_device_hit(model, device, monkeypatch, kvdepot_env_cleared):
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", str(CHUNK))
    destroy_engine()
    try:
        _scenario(model, device, (KvDepotConnectorScheduler, KvDepotConnectorWorker))
        stats = current_engine().stats()
        assert stats.live_leases == 0 and stats.inflight_transfers == 0
    finally:
        destroy_engine()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_server_mode_hit_is_the_device_hit(model, device, server_url, monkeypatch, kvdepot_env_cleared):
    monkeypatch.setenv("KVDEPOT_SERVER_URL", server_url)  # 1.2: not in kv_connector_config

    def ready() -> None:
        deadline = time.monotonic() + 20
        while providers.current_remote() is None:
            assert time.monotonic() < deadline, "the worker never registered with the server"
            time.sleep(0.01)

    try:
        _scenario(model, device, (mp_adapter.KvDepotMPConnectorScheduler, mp_adapter.KvDepotMPConnectorWorker), ready)
    finally:
        providers.destroy_engine()
