"""End to end through real vLLM (CPU backend) and a ``kvdepot server`` subprocess, vLLM's own
prefix caching off: the connector in server mode (``server_url``).

First engine: vLLM's default multiprocessing (engine core with the scheduler in one process,
the worker in another; the CPU platform's ``mp`` executor), prompts A, A, B as in
test_vllm_e2e.py: a miss saved chunk by chunk, a hit of 1792 tokens, a shared-prefix hit of
1024 tokens, outputs identical to vLLM alone. Second engine, a separate process started after
the first exited, with multiprocessing off (scheduler and worker in one process, each with its
own connection): A hits what the first engine stored in the server. The server's own figures
must agree, and no lease or pin may outlive the engines.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
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
from kvdepot.server.client import DepotClient
from kvdepot.server.protocol import GetStats

sys.path.insert(0, str(Path(__file__).parents[2] / "server"))  # the server tests' helpers
from mp_helpers import short_dir, start_server, stop_server, wait_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)]

A, B = prompts()


def server_stats(url: str) -> Any:
    client = DepotClient(url, timeout_s=5.0, name="test")
    try:
        reply, _ = client.call(GetStats())
    finally:
        client.close()
    return reply


def shard_figures(reply: Any) -> dict[str, float]:
    [shard] = reply.shards  # one model, one rank
    return shard.figures


@pytest.fixture(scope="module")
def runs(tiny_model: str, vllm_alone: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kvdepot-server-e2e")
    sock_dir = short_dir()
    url = f"ipc://{sock_dir}/s.sock"
    server = start_server(url, "--chunk-size", str(CHUNK), "--host-capacity-gb", "0.25", "--session-timeout-s", "3")
    try:
        common = {**COMMON, "model": tiny_model, "connector": True}
        first = Child({**common, "prompts": [A, A, B], "multiprocessing": True,
                       "extra_config": {"server_url": url, "stats_file": str(tmp / "first.jsonl")}})
        out: dict[str, Any] = {"base": vllm_alone.results(), "first": first.result(timeout_s=500)}
        out["after_first"] = server_stats(url)
        second = Child({**common, "prompts": [A], "multiprocessing": False,
                        "extra_config": {"server_url": url, "stats_file": str(tmp / "second.jsonl")}})
        out["second"] = second.result(timeout_s=400)
        # vLLM may kill its processes before the connector's shutdown: their sessions time out.
        wait_for(lambda: server_stats(url).sessions == 1, timeout=20)  # 1: the stats call's own
        out["final"] = server_stats(url)
        out["events"] = read_events(tmp / "first.jsonl")
        out["second_events"] = read_events(tmp / "second.jsonl")
        yield out
    finally:
        stop_server(server)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_scheduler_and_worker_ran_in_different_processes(runs: dict[str, Any]) -> None:
    events = runs["events"]
    scheduler = {e["pid"] for e in by_event(events, "lookup")}
    worker = {e["pid"] for e in by_event(events, "register") + by_event(events, "store") + by_event(events, "load")}
    assert len(scheduler) == 1 and len(worker) == 1 and scheduler != worker


def test_miss_then_hits_through_the_server_with_vllm_alone_output(runs: dict[str, Any]) -> None:
    lookups = by_event(runs["events"], "lookup")
    assert [(e["tokens"], e["cached"], e["new_matched"]) for e in lookups] == [(2000, 0, 0), (2000, 1792, 1792),
                                                                              (2000, 1024, 1024)]
    results, base = runs["first"]["results"], runs["base"]
    assert [r["num_cached_tokens"] for r in results] == [0, 1792, 1024]  # vLLM's own count of tokens not computed
    for got, want in zip(results, [base[0], base[0], base[1]], strict=True):
        assert_same_output(got, want)
    loads = by_event(runs["events"], "load")
    assert [(e["blocks"], e["wanted"]) for e in loads] == [(14, 14), (8, 8)]
    stores = [e for e in by_event(runs["events"], "store") if e["req"] == lookups[0]["req"]]
    assert len(stores) >= 4 and stores[-1]["upto_chunk"] == 2000 // CHUNK  # every 512-token prefill step saved


def test_the_servers_figures_show_the_stores_and_the_hits(runs: dict[str, Any]) -> None:
    figures = shard_figures(runs["after_first"])
    assert figures["stored_chunks"] == 7 + 3 and figures["loaded_chunks"] == 7 + 4  # A: 7 stored; B: 4 loaded, 3 stored
    [group] = [s.group for s in runs["after_first"].shards]
    assert "tag=vllm:CPU_ATTN:LBHNC" in group  # vLLM's chunks never share keys with TensorRT-LLM pools


def test_a_second_vllm_process_hits_what_the_first_stored(runs: dict[str, Any]) -> None:
    [lookup] = by_event(runs["second_events"], "lookup")
    assert (lookup["cached"], lookup["new_matched"]) == (1792, 1792)
    [result] = runs["second"]["results"]
    assert result["num_cached_tokens"] == 1792
    assert_same_output(result, runs["base"][0])
    assert shard_figures(runs["final"])["loaded_chunks"] == 7 + 4 + 7


def test_no_lease_or_pin_outlives_the_engines(runs: dict[str, Any]) -> None:
    final = runs["final"]
    figures = shard_figures(final)
    assert final.sessions == 1 and final.mappings == 0 and final.prefetches == 0  # 1: the stats call's own
    assert figures["live_leases"] == 0 and figures["pinned_chunks"] == 0 and figures["inflight_transfers"] == 0
    assert figures["stored_chunks"] == 10  # the second engine loaded A and stored nothing new
