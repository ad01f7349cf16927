"""``KvDepotConnector`` driven the way vLLM's scheduler and model runner drive it, in one process,
with vLLM's own config and KV-cache-config types and stand-ins for requests and scheduler
outputs: the contract (leases, loads, saves, request_finished / get_finished, preemption,
load errors) without running a model. The real engine runs in test_vllm_e2e.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from vllm_helpers import SKIP_REASON, VLLM_MISSING
from vllm_rig import (
    TOKENS,
    Rig,
    blocks,
    cached_step,
    empty_step,
    engine,
    new_step,
    request,
    serve_miss,
)

from kvdepot.engine_api import Lease

pytestmark = pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)



@pytest.fixture(scope="module", autouse=True)
def vllm_imported() -> None:
    """Importing vLLM takes ~10 s on 2 cores: paid once here, not by the first test."""
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401


def test_miss_saves_then_hit_loads_the_same_bytes(tmp_path) -> None:
    rig = Rig(tmp_path)
    serve_miss(rig, "a", TOKENS, [1, 2, 3, 4, 5])
    assert engine().stats().stored_chunks == 2
    req = request("b", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (64, False)
    rig.sched.update_state_after_alloc(req, blocks([9, 8, 7, 6, 10]), 64)
    rig.step(new_step("b", [9, 8, 7, 6, 10], 64, 16), computed_blocks=[10])
    for t in rig.caches.values():
        for src, dst in zip([1, 2, 3, 4], [9, 8, 7, 6], strict=True):
            assert torch.equal(t[dst], t[src])
    assert rig.worker.get_block_ids_with_load_errors() == set()
    assert rig.sched.request_finished(req, [9, 8, 7, 6, 10]) == (True, None)  # told to save (all cached)
    assert rig.worker.get_finished({"b"}) == ({"b"}, None)
    assert [e["new_matched"] for e in rig.events("lookup")] == [0, 64]
    assert not [e for e in rig.events("store") if e["req"] == "b"]  # loaded chunks are not stored again
    stats = engine().stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0


def test_at_least_one_token_is_left_to_compute(tmp_path) -> None:
    rig = Rig(tmp_path)
    serve_miss(rig, "a", TOKENS[:64], [1, 2, 3, 4])  # exactly 2 chunks, all cached
    assert rig.sched.get_num_new_matched_tokens(request("b", TOKENS[:64]), 0) == (48, False)


def test_lookup_again_and_a_refused_load_release_the_lease(tmp_path) -> None:
    rig = Rig(tmp_path)
    serve_miss(rig, "a", TOKENS, [1, 2, 3, 4, 5])
    req = request("b", TOKENS)
    rig.sched.get_num_new_matched_tokens(req, 0)
    rig.sched.get_num_new_matched_tokens(req, 0)  # vLLM asks again when it could not schedule it
    assert engine().stats().live_leases == 1
    rig.sched.update_state_after_alloc(req, blocks([6, 7, 8, 9, 10]), 0)  # vLLM took no external tokens
    assert engine().stats().live_leases == 0
    meta = rig.step(new_step("b", [6, 7, 8, 9, 10], 0, 80), computed_blocks=[6, 7, 8, 9, 10])
    assert meta.requests[0].load_num_blocks == 0


def test_chunked_prefill_saves_each_chunk_when_it_is_computed(tmp_path) -> None:
    rig = Rig(tmp_path)
    req = request("a", TOKENS)
    rig.sched.get_num_new_matched_tokens(req, 0)
    rig.sched.update_state_after_alloc(req, blocks([1, 2]), 0)
    m1 = rig.step(new_step("a", [1, 2], 0, 32), computed_blocks=[1, 2])
    m2 = rig.step(cached_step("a", [3, 4], 32, 32), computed_blocks=[3, 4])
    m3 = rig.step(cached_step("a", [5], 64, 16), computed_blocks=[5])
    assert [m.requests[0].save_upto_chunks for m in (m1, m2)] == [1, 2] and m3.requests == []
    assert [(e["first_chunk"], e["upto_chunk"]) for e in rig.events("store")] == [(0, 1), (1, 2)]
    assert m1.requests[0].new_keys and m2.requests[0].new_block_ids == [3, 4]  # deltas only


def test_preempted_request_is_not_held_and_restarts_cleanly(tmp_path) -> None:
    rig = Rig(tmp_path)
    req = request("a", TOKENS)
    rig.sched.get_num_new_matched_tokens(req, 0)
    rig.sched.update_state_after_alloc(req, blocks([1, 2]), 0)
    rig.step(new_step("a", [1, 2], 0, 32), computed_blocks=[1, 2])
    rig.step(empty_step(preempted={"a"}))  # vLLM preempted it and freed its blocks
    # Back from preemption: a new lookup finds the chunk it saved, new blocks, a reset.
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (32, False)
    rig.sched.update_state_after_alloc(req, blocks([7, 8, 9, 10, 11]), 32)
    meta = rig.step(cached_step("a", [7, 8, 9, 10, 11], 32, 48, resumed=True), computed_blocks=[9, 10, 11])
    item = meta.requests[0]
    assert item.reset and item.new_block_ids == [7, 8, 9, 10, 11] and item.load_num_blocks == 2
    for t in rig.caches.values():
        assert torch.equal(t[7], t[1]) and torch.equal(t[8], t[2])
    assert rig.sched.request_finished(req, []) == (True, None)
    assert rig.worker.get_finished({"a"}) == ({"a"}, None)


def test_preempted_then_aborted_request_is_not_delayed(tmp_path) -> None:
    rig = Rig(tmp_path)
    req = request("a", TOKENS)
    rig.sched.get_num_new_matched_tokens(req, 0)
    rig.sched.update_state_after_alloc(req, blocks([1, 2]), 0)
    rig.step(new_step("a", [1, 2], 0, 32), computed_blocks=[1, 2])
    rig.step(empty_step(preempted={"a"}))
    assert rig.sched.request_finished(req, []) == (False, None)  # its blocks are gone already
    assert rig.worker.get_finished({"a"}) == (None, None)


def test_salted_lora_and_multimodal_requests_do_not_share_plain_keys(tmp_path) -> None:
    rig = Rig(tmp_path)
    serve_miss(rig, "a", TOKENS, [1, 2, 3, 4, 5])
    lora = SimpleNamespace(lora_name="adapter", lora_int_id=1)
    assert rig.sched.get_num_new_matched_tokens(request("s", TOKENS, cache_salt="tenant-2"), 0)[0] == 0
    assert rig.sched.get_num_new_matched_tokens(request("l", TOKENS, lora_request=lora), 0)[0] == 0
    assert rig.sched.get_num_new_matched_tokens(request("m", TOKENS, mm_features=[object()]), 0)[0] == 0
    assert rig.sched.get_num_new_matched_tokens(request("p", TOKENS), 0)[0] == 64


def test_a_chunk_lost_before_its_load_is_reported_as_a_load_error(tmp_path) -> None:
    rig = Rig(tmp_path)
    serve_miss(rig, "a", TOKENS, [1, 2, 3, 4, 5])
    req = request("b", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(req, 0)[0] == 64
    eng = engine()
    eng.release(Lease("b"))  # as if the lease had expired ...
    assert eng.host.delete(eng.chunk_keys(TOKENS)[1])  # ... and the second chunk was evicted
    rig.sched.update_state_after_alloc(req, blocks([6, 7, 8, 9, 10]), 64)
    rig.step(new_step("b", [6, 7, 8, 9, 10], 64, 16), computed_blocks=[10])
    assert rig.worker.get_block_ids_with_load_errors() == {8, 9}  # vLLM recomputes or fails them
    assert rig.worker.get_block_ids_with_load_errors() == set()


def test_worker_in_another_process_turns_kvdepot_off_loudly(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvdepot")
    rig = Rig(tmp_path, backend="mp")
    assert "runs the worker in another process" in caplog.text
    req = request("a", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    rig.sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    meta = rig.step(new_step("a", [1, 2, 3, 4, 5], 0, 80), computed_blocks=[1, 2, 3, 4, 5])
    assert meta.requests == [] and rig.sched.request_finished(req, []) == (False, None)


def test_metadata_pickles_small(tmp_path) -> None:
    import pickle

    rig = Rig(tmp_path)
    req = request("a", TOKENS)
    rig.sched.get_num_new_matched_tokens(req, 0)
    rig.sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    meta = rig.sched.build_connector_meta(new_step("a", [1, 2, 3, 4, 5], 0, 80))
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    assert isinstance(meta, KVConnectorMetadata)
    assert pickle.loads(pickle.dumps(meta)) == meta and len(pickle.dumps(meta)) < 1024


def test_kv_role_producer_only_saves_and_consumer_only_loads(tmp_path) -> None:
    producer = Rig(tmp_path / "p", role="kv_producer") if (tmp_path / "p").mkdir() is None else None
    serve_miss(producer, "a", TOKENS, [1, 2, 3, 4, 5])
    assert producer.sched.get_num_new_matched_tokens(request("b", TOKENS), 0) == (0, False)  # never loads
    consumer = Rig(tmp_path / "c", role="kv_consumer") if (tmp_path / "c").mkdir() is None else None
    req = request("c", TOKENS)  # the same process engine: A's chunks are there
    assert consumer.sched.get_num_new_matched_tokens(req, 0) == (64, False)
    consumer.sched.update_state_after_alloc(req, blocks([6, 7, 8, 9, 10]), 64)
    meta = consumer.step(new_step("c", [6, 7, 8, 9, 10], 64, 16), computed_blocks=[10])
    assert meta.requests[0].save_upto_chunks == 0 and consumer.sched.request_finished(req, []) == (False, None)
