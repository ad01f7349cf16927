"""End to end: our TensorRT-LLM adapter driven by the reference runtime, as TensorRT-LLM drives it.

The runtime's own pool is sized to hold about one long prompt, so its device block reuse cannot
explain a hit: when a prompt comes back after another one evicted it, the lookup log line shows
``trt_matched=0`` and the tokens come from kvdepot. Outputs must equal a run without any connector.
"""

from __future__ import annotations

import logging
import random
import re
from typing import Any

import pytest
import torch

from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
)
from kvdepot.integrations.tensorrt_llm.providers import current_engine
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

TPB = 32
LOOKUP = re.compile(r"req=(\d+) trt_matched=(\d+) cached=(\d+) new_matched=(\d+)")


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def filler(max_tokens: int, new_tokens: int, seed: int = 99) -> list[int]:
    """A prompt that, with its new tokens, needs the whole pool: it evicts everything cached there."""
    return prompt(max_tokens - new_tokens + 1, seed)


def engine(max_tokens: int, connector: Any = (KvDepotConnectorScheduler, KvDepotConnectorWorker), **args: Any) -> Engine:
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=max_tokens), **args)
    return Engine("tiny", llm_args=llm_args, connector=connector, seed=0)


def lookups(caplog: pytest.LogCaptureFixture) -> dict[int, tuple[int, int, int]]:
    found = {}
    for record in caplog.records:
        m = LOOKUP.search(record.getMessage())
        if m and record.name == "kvdepot":
            found[int(m[1])] = (int(m[2]), int(m[3]), int(m[4]))
    return found


def assert_same(a, b) -> None:
    assert a.output_ids == b.output_ids
    for x, y in zip(a.logits, b.logits, strict=False):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_seed_scenario_hit_comes_from_kvdepot(caplog: pytest.LogCaptureFixture) -> None:
    """Seed 000: A fills kvdepot and the engine, B evicts A from the engine, A again hits kvdepot."""
    caplog.set_level(logging.INFO, logger="kvdepot")
    a, b = prompt(2100, 1), prompt(2100, 2)
    baseline = engine(2112, connector=None).generate([a], 6)[0]
    eng = engine(2112)  # exactly one request: B must evict all of A
    first = eng.generate([a], 6)[0]
    eng.generate([b], 6)
    third = eng.generate([a], 6)[0]
    trt, cached, new = lookups(caplog)[third.request_id]
    assert trt == 0 and new > 0 and cached >= new
    assert third.num_device_reused_tokens == 0 and third.num_connector_matched_tokens == new
    assert new == 2048  # every full 256-token chunk of the 2100-token prompt was saved and loaded
    assert_same(first, baseline)
    assert_same(third, baseline)
    stats = current_engine().stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0 and stats.inflight_transfers == 0


def test_shared_prefix_with_different_suffixes(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    caplog.set_level(logging.INFO, logger="kvdepot")
    prefix = prompt(640, 3)
    one, two = prefix + prompt(100, 4), prefix + prompt(130, 5)
    eng = engine(1024)
    eng.generate([one], 4)
    eng.generate([filler(1024, 4)], 4)  # evicts the shared prefix from the device
    got = eng.generate([two], 4)[0]
    trt, _cached, new = lookups(caplog)[got.request_id]
    assert trt == 0 and new == 640
    assert_same(got, engine(1024, connector=None).generate([two], 4)[0])


def test_chunked_prefill_saves_every_chunk(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt computed in several prefill chunks is saved whole (later chunks included)."""
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    caplog.set_level(logging.INFO, logger="kvdepot")
    a = prompt(1000, 7)
    eng = engine(1088, max_num_tokens=192)  # 1000 tokens in 6 prefill steps
    first = eng.generate([a], 4)[0]
    eng.generate([filler(1088, 4)], 4)
    again = eng.generate([a], 4)[0]
    trt, _cached, new = lookups(caplog)[again.request_id]
    assert trt == 0 and new == 960  # 15 full chunks of 64
    assert_same(again, first)


def test_concurrent_requests_hit_together(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    caplog.set_level(logging.INFO, logger="kvdepot")
    prompts = [prompt(500 + 37 * i, 10 + i) for i in range(3)]
    eng = engine(1696)
    first = eng.generate(prompts, 5)
    eng.generate([filler(1696, 5)], 5)
    again = eng.generate(prompts, 5)
    seen = lookups(caplog)
    for before, after in zip(first, again, strict=False):
        trt, _cached, new = seen[after.request_id]
        assert trt == 0 and new == (before.prompt_len // 64) * 64
        assert_same(after, before)


def test_partial_device_hit_loads_only_the_rest(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine keeps A's first blocks; kvdepot loads the others and never writes the kept ones."""
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    caplog.set_level(logging.INFO, logger="kvdepot")
    allocations: dict[int, list[int]] = {}

    class Scheduler(KvDepotConnectorScheduler):
        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
            allocations[request.py_request_id] = list(block_ids)
            super().update_state_after_alloc(request, block_ids)

    a = prompt(1024, 30)
    eng = engine(1024 + 640, connector=(Scheduler, KvDepotConnectorWorker))
    first = eng.generate([a], 4)[0]
    eng.generate([prompt(1000, 31)], 4)  # frees A's tail first, so the tail is what gets evicted
    written: list[int] = []
    depot = current_engine()
    scatter_many = depot.mover.scatter_many

    def recording_scatter_many(copies, views):
        written.extend(b for c in copies for b in c.block_ids)
        return scatter_many(copies, views)

    monkeypatch.setattr(depot.mover, "scatter_many", recording_scatter_many)
    again = eng.generate([a], 4)[0]
    trt, _cached, new = lookups(caplog)[again.request_id]
    assert trt > 0 and new > 0 and trt + new == 1024 - TPB
    kept = allocations[again.request_id][: trt // TPB]
    loaded = allocations[again.request_id][trt // TPB : (trt + new) // TPB]
    assert sorted(written) == sorted(loaded) and not set(written) & set(kept)
    assert_same(again, first)


def test_decode_chunks_saved_when_configured(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    monkeypatch.setenv("KVDEPOT_SAVE_DECODE_CACHE", "true")
    caplog.set_level(logging.INFO, logger="kvdepot")
    a = prompt(100, 40)
    eng = engine(640)
    first = eng.generate([a], 60)[0]  # 100 + 60 tokens: chunks 0 and 1 are complete after decode
    follow_up = a + first.output_ids  # a multi-turn follow-up starts with the whole conversation
    eng.generate([filler(640, 4)], 4)
    got = eng.generate([follow_up], 4)[0]
    trt, _cached, new = lookups(caplog)[got.request_id]
    assert trt == 0 and new == 128
    assert_same(got, engine(640, connector=None).generate([follow_up], 4)[0])


def test_without_decode_saving_only_prompt_chunks(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    caplog.set_level(logging.INFO, logger="kvdepot")
    a = prompt(100, 40)
    eng = engine(640)
    first = eng.generate([a], 60)[0]
    eng.generate([filler(640, 4)], 4)
    got = eng.generate([a + first.output_ids], 4)[0]
    assert lookups(caplog)[got.request_id] == (0, 64, 64)
