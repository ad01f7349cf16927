"""End to end through real vLLM (CPU backend), vLLM's own prefix caching off: a hit can only
come from kvdepot. Two engines run side by side in child processes — vLLM alone (conftest's
``vllm_alone``), and vLLM with ``KvDepotConnector`` in-process — over the same prompts; outputs
must agree, and the connector's stats file (written inside vLLM's engine) must show where the
hits came from.

Connector engine, in order: A (2000 tokens: a miss, saved chunk by chunk through a chunked
prefill of 512-token steps), A again (a hit of every full 256-token chunk: 1792 tokens), then
B = A[:1100] + a new suffix (a hit of the shared prefix's full chunks: 1024 tokens).
That engine also writes behind to a local redis-server; a third engine, started after it
exited (``kv_load_failure_policy: recompute``), finds A in Redis: its first request is served
from there through vLLM's async-load path, its second one from host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_helpers import (
    CHUNK,
    COMMON,
    SKIP_REASON,
    VLLM_MISSING,
    assert_same_output,
    by_event,
    prompts,
    read_events,
)

from kvdepot.bench.vllm import Child
from redis_server import REDIS_SERVER, RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)]

A, B = prompts()


@pytest.fixture(scope="module")
def runs(tiny_model: str, vllm_alone: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kvdepot-e2e")
    redis = RedisServer(tmp) if REDIS_SERVER else None
    if redis is not None:
        redis.start()
    try:
        common = {**COMMON, "model": tiny_model}
        extra = {"chunk_size": CHUNK, "host_capacity_gb": 0.25, "log_level": "INFO"}  # its lookup lines are INFO
        if redis is not None:
            extra["remote_url"] = redis.url  # the connector engine also writes behind to Redis
        with_kv = Child({**common, "prompts": [A, A, B], "connector": True,
                         "extra_config": {**extra, "stats_file": str(tmp / "stats.jsonl")}})
        base, conn = vllm_alone.results(), with_kv.result(timeout_s=400)
        out = {"base": base, "conn": conn["results"], "events": read_events(tmp / "stats.jsonl"),
               "log": conn["log"], "second": None}
        if redis is not None:
            # A second vLLM process, empty host memory, the same Redis: A's chunks come from there.
            second = Child({**common, "prompts": [A, A], "connector": True, "kv_load_failure_policy": "recompute",
                            "extra_config": {**extra, "stats_file": str(tmp / "second.jsonl")}})
            out["second"] = {"results": second.result(timeout_s=400)["results"], "events": read_events(tmp / "second.jsonl")}
        yield out
    finally:
        if redis is not None:
            redis.stop()


def test_first_request_is_a_miss_with_vllm_alone_output(runs: dict[str, Any]) -> None:
    first = by_event(runs["events"], "lookup")[0]
    assert (first["tokens"], first["cached"], first["new_matched"]) == (2000, 0, 0)
    assert runs["conn"][0]["num_cached_tokens"] == 0
    assert_same_output(runs["conn"][0], runs["base"][0])


def test_repeated_prompt_hits_kvdepot_with_identical_output(runs: dict[str, Any]) -> None:
    lookup = by_event(runs["events"], "lookup")[1]
    assert (lookup["vllm_matched"], lookup["cached"], lookup["new_matched"]) == (0, 1792, 1792)
    load = by_event(runs["events"], "load")[0]
    assert load["req"] == lookup["req"] and load["blocks"] == load["wanted"] == 1792 // 128
    assert runs["conn"][1]["num_cached_tokens"] == 1792  # vLLM's own count of tokens it did not compute
    assert_same_output(runs["conn"][1], runs["base"][0])
    assert "lookup req=" in runs["log"] and "cached=1792 new_matched=1792" in runs["log"]


def test_shared_prefix_with_a_different_suffix(runs: dict[str, Any]) -> None:
    lookup = by_event(runs["events"], "lookup")[2]
    assert (lookup["cached"], lookup["new_matched"]) == (1024, 1024)  # 1100 shared tokens: 4 full chunks
    assert runs["conn"][2]["num_cached_tokens"] == 1024
    assert_same_output(runs["conn"][2], runs["base"][1])
    assert runs["conn"][2]["token_ids"] != runs["conn"][1]["token_ids"]  # the suffix matters


def test_every_full_chunk_of_a_chunked_prefill_is_saved(runs: dict[str, Any]) -> None:
    first_req = by_event(runs["events"], "lookup")[0]["req"]
    stores = [e for e in by_event(runs["events"], "store") if e["req"] == first_req]
    assert len(stores) >= 4  # one per 512-token prefill step, not only the first
    assert [s["first_chunk"] for s in stores] == [0] + [s["upto_chunk"] for s in stores[:-1]]
    assert stores[-1]["upto_chunk"] == 2000 // CHUNK and sum(s["new_chunks"] for s in stores) == 7
    # The hit request loaded its chunks: nothing of them is stored again.
    hit_req = by_event(runs["events"], "lookup")[1]["req"]
    assert not [e for e in by_event(runs["events"], "store") if e["req"] == hit_req]


def test_engine_ends_with_no_leases_pins_or_transfers(runs: dict[str, Any]) -> None:
    final = by_event(runs["events"], "shutdown")[-1]["stats"]
    assert final["live_leases"] == 0 and final["pinned_chunks"] == 0 and final["inflight_transfers"] == 0
    assert final["stored_chunks"] == 7 + 3 and final["loaded_chunks"] == 7 + 4  # A: 7 stored; B: 4 loaded, 3 stored
    finished = [r for e in by_event(runs["events"], "finished") for r in e["req"]]
    assert len(finished) == len(set(finished))  # each delayed request reported once


def test_second_vllm_process_hits_what_the_first_wrote_to_redis(runs: dict[str, Any]) -> None:
    if runs["second"] is None:
        pytest.skip("redis-server binary not found: apt-get install redis-server")
    events = runs["second"]["events"]
    lookups = by_event(events, "lookup")
    # First request: nothing in this process's host memory; Redis has it -> loaded asynchronously.
    assert [(e["cached"], e["host"], e["new_matched"], e["load_async"]) for e in lookups] == [
        (1792, 0, 1792, True), (1792, 1792, 1792, False)]
    [load] = [e for e in by_event(events, "load") if e.get("mode") == "async"]
    assert load["req"] == lookups[0]["req"] and load["blocks"] == load["wanted"] == 1792 // 128
    first, again = runs["second"]["results"]
    assert first["num_cached_tokens"] == 1792 and again["num_cached_tokens"] == 1792
    assert_same_output(first, runs["base"][0])
    assert_same_output(again, runs["base"][0])
