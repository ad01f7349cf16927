"""The adapter's side of TensorRT-LLM's connector contract, checked call by call."""

from __future__ import annotations

import logging
import pickle
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvdepot.errors import ConfigError, LayoutError
from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
)
from kvdepot.integrations.tensorrt_llm.api import RequestData, SchedulerOutput
from kvdepot.integrations.tensorrt_llm.metadata import KvDepotMetadata
from kvdepot.integrations.tensorrt_llm.providers import current_engine
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

TPB = 32
HOOKS = (
    "register_kv_caches", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "request_finished", "get_finished",
)


def counting(counts: Counter, returns: dict[str, list]) -> tuple[type, type]:
    """Subclasses of our classes that count every hook call and keep what it returned."""

    def counted(name: str, original: Any) -> Any:
        def hook(self, *args, **kwargs):
            counts[name] += 1
            result = original(self, *args, **kwargs)
            returns.setdefault(name, []).append(result)
            return result

        return hook

    def wrap(base: type) -> type:
        namespace = {name: counted(name, getattr(base, name)) for name in HOOKS if hasattr(base, name)}
        return type("Counting" + base.__name__, (base,), namespace)

    return wrap(KvDepotConnectorScheduler), wrap(KvDepotConnectorWorker)


def run_one(monkeypatch: pytest.MonkeyPatch, tokens: int, new: int) -> tuple[Counter, dict[str, list], Engine]:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    counts: Counter = Counter()
    returns: dict[str, list] = {}
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=1024), max_num_tokens=128)
    eng = Engine("tiny", llm_args=llm_args, connector=counting(counts, returns), seed=0)
    rng = random.Random(5)
    eng.generate([[rng.randrange(512) for _ in range(tokens)]], new)
    return counts, returns, eng


def test_call_counts_follow_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    counts, returns, eng = run_one(monkeypatch, 300, 8)
    steps = counts["build_connector_meta"]
    assert steps == 3 + 7  # 300 tokens in 128-token chunks, then 7 decode steps (the 1st token comes with prefill)
    assert counts["register_kv_caches"] == 1
    assert counts["get_num_new_matched_tokens"] == 1 and counts["update_state_after_alloc"] == 1
    assert counts["start_load_kv"] == counts["wait_for_save"] == steps
    layers = eng.model.config.num_layers
    assert counts["wait_for_layer_load"] == counts["save_kv_layer"] == layers * steps
    # 1.2's overlap scheduler hands request_finished over one iteration later: one more get_finished.
    assert counts["request_finished"] == 1 and counts["get_finished"] == steps + 1
    for meta in returns["build_connector_meta"]:
        assert isinstance(meta, KvDepotMetadata)
        assert pickle.loads(pickle.dumps(meta)) == meta  # TensorRT-LLM broadcasts it with MPI


def test_async_save_reports_each_request_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _counts, returns, _eng = run_one(monkeypatch, 300, 4)
    assert returns["request_finished"] == [True]  # it saved chunks: blocks held until get_finished
    reported = [rid for saved, _loaded in returns["get_finished"] for rid in saved]
    assert reported == [1]
    stats = current_engine().stats()
    assert stats.stored_chunks == 4 and stats.live_leases == 0 and stats.inflight_transfers == 0


def test_request_without_saves_is_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    _counts, returns, _eng = run_one(monkeypatch, 40, 2)  # shorter than one chunk: nothing to save
    assert returns["request_finished"] == [False]


@dataclass
class FakeRequest:
    """The C++ LlmRequest view the scheduler sees in get_num_new_matched_tokens."""

    request_id: int
    tokens: list[int]

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


def setup_pair(monkeypatch: pytest.MonkeyPatch, blocks: int = 64, **env: str) -> tuple[Any, Any, torch.Tensor]:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB))
    scheduler, worker = KvDepotConnectorScheduler(llm_args), KvDepotConnectorWorker(llm_args)
    pool = torch.randn(blocks, 2, 2, 4 * TPB * 8)
    return scheduler, worker, pool


def save_prompt(scheduler: Any, worker: Any, rid: int, tokens: list[int]) -> None:
    """Drive one whole prefill step for ``tokens`` through the pair (blocks 0..n-1)."""
    assert scheduler.get_num_new_matched_tokens(FakeRequest(rid, tokens), 0)[1] is False
    blocks = list(range(-(-len(tokens) // TPB)))
    scheduler.update_state_after_alloc(FakeRequest(rid, tokens), blocks)
    out = SchedulerOutput(new_requests=[RequestData(rid, tokens, blocks, 0, len(tokens))])
    worker.bind_connector_meta(scheduler.build_connector_meta(out))
    worker.start_load_kv(None)
    worker.wait_for_save(None)
    worker.get_finished([], [])  # TensorRT-LLM polls every iteration; this enqueues the step's saves


def test_saves_are_enqueued_after_sampling_not_in_wait_for_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_for_save only notes the saves (the sampler's copy must not queue behind them); the
    next get_finished enqueues them, and the request is reported once they are done."""
    scheduler, worker, pool = setup_pair(monkeypatch)
    worker.register_kv_caches(pool)
    tokens = list(range(256))
    blocks = list(range(len(tokens) // TPB))
    scheduler.get_num_new_matched_tokens(FakeRequest(1, tokens), 0)
    scheduler.update_state_after_alloc(FakeRequest(1, tokens), blocks)
    out = SchedulerOutput(new_requests=[RequestData(1, tokens, blocks, 0, len(tokens))])
    worker.bind_connector_meta(scheduler.build_connector_meta(out))
    worker.start_load_kv(None)
    worker.wait_for_save(None)
    engine = current_engine()
    assert engine.stats().stored_chunks == 0
    assert scheduler.request_finished(FakeRequest(1, tokens), blocks) is True
    assert worker.get_finished([1], []) == ([1], [])
    assert engine.stats().stored_chunks == 4
    assert engine.lookup(engine.chunk_keys(tokens)) == 256


def test_scheduler_answers_no_hit_until_the_worker_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, worker, pool = setup_pair(monkeypatch)
    assert scheduler.get_num_new_matched_tokens(FakeRequest(1, list(range(300))), 0) == (0, False)
    assert scheduler.build_connector_meta(SchedulerOutput()) == KvDepotMetadata()
    worker.register_kv_caches(pool)
    assert scheduler.build_connector_meta(SchedulerOutput()) == KvDepotMetadata()


def test_matches_are_block_aligned_and_leave_a_token_to_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, worker, pool = setup_pair(monkeypatch)
    worker.register_kv_caches(pool)
    tokens = list(range(256))  # exactly 4 chunks, all saved
    save_prompt(scheduler, worker, 1, tokens)
    assert scheduler.request_finished(FakeRequest(1, tokens), list(range(8))) is True
    assert worker.get_finished([1], []) == ([1], [])
    assert scheduler.get_num_new_matched_tokens(FakeRequest(2, tokens), 0) == (224, False)  # not 256
    assert scheduler.get_num_new_matched_tokens(FakeRequest(3, tokens), 16) == (0, False)  # unaligned
    assert scheduler.get_num_new_matched_tokens(FakeRequest(4, tokens), 64) == (160, False)
    for rid in (2, 3, 4):
        scheduler.request_finished(FakeRequest(rid, tokens), [])
    assert current_engine().stats().live_leases == 0


def test_request_id_seen_twice_replaces_its_state(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    scheduler, worker, pool = setup_pair(monkeypatch)
    worker.register_kv_caches(pool)
    tokens = list(range(300))
    save_prompt(scheduler, worker, 1, tokens)
    scheduler.request_finished(FakeRequest(1, tokens), [])
    worker.get_finished([1], [])
    with caplog.at_level(logging.WARNING, logger="kvdepot"):
        assert scheduler.get_num_new_matched_tokens(FakeRequest(7, tokens), 0) == (256, False)
        assert scheduler.get_num_new_matched_tokens(FakeRequest(7, tokens[:200]), 0) == (192, False)
    assert "seen again" in caplog.text
    assert current_engine().stats().live_leases == 1  # the first lookup's lease was released
    scheduler.request_finished(FakeRequest(7, tokens), [])
    assert current_engine().stats().live_leases == 0


def test_tensor_parallel_in_process_never_claims_hits(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB))
    llm_args.tensor_parallel_size = 2
    scheduler, worker = KvDepotConnectorScheduler(llm_args), KvDepotConnectorWorker(llm_args)
    worker.register_kv_caches(torch.zeros(16, 2, 2, 4 * TPB * 8))
    with caplog.at_level(logging.WARNING, logger="kvdepot"):
        assert scheduler.get_num_new_matched_tokens(FakeRequest(1, list(range(300))), 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(FakeRequest(2, list(range(300))), 0) == (0, False)
    assert caplog.text.count("multi-process adapter") == 1


@pytest.mark.parametrize(
    ("pool", "error"),
    [
        (torch.zeros(16, 2, 4 * TPB * 8), LayoutError),  # 3-D
        (torch.zeros(16, 2, 2, 4 * TPB * 8, dtype=torch.bool), LayoutError),
        (torch.zeros(16, 2, 3, 4 * TPB * 8), LayoutError),  # kv_factor 3
        (torch.zeros(16, 2, 2, 4 * TPB * 8)[:, :, :1], LayoutError),  # not contiguous
    ],
)
def test_bad_pools_are_refused(monkeypatch: pytest.MonkeyPatch, pool: torch.Tensor, error: type) -> None:
    _scheduler, worker, _ = setup_pair(monkeypatch)
    with pytest.raises(error):
        worker.register_kv_caches(pool)
    assert current_engine() is None


def test_config_that_cannot_hold_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    _scheduler, worker, pool = setup_pair(monkeypatch, KVDEPOT_HOST_CAPACITY_GB="0.0000001")
    with pytest.raises(ConfigError, match="host_capacity_gb"):
        worker.register_kv_caches(pool)


def test_chunk_size_must_be_a_multiple_of_tokens_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    _scheduler, worker, pool = setup_pair(monkeypatch, KVDEPOT_CHUNK_SIZE="48")
    with pytest.raises(LayoutError, match="multiple"):
        worker.register_kv_caches(pool)


def test_reload_reuses_the_engine_and_keeps_its_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, worker, pool = setup_pair(monkeypatch)
    worker.register_kv_caches(pool)
    tokens = list(range(300))
    save_prompt(scheduler, worker, 1, tokens)
    engine = current_engine()
    new_pool = torch.zeros_like(pool)
    KvDepotConnectorWorker(TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB))).register_kv_caches(new_pool)
    assert current_engine() is engine
    assert engine.lookup(engine.chunk_keys(tokens)) == 256
    with pytest.raises(LayoutError):
        worker.register_kv_caches(torch.zeros(8, 3, 2, 4 * TPB * 8))  # another geometry
