"""First-request hits from Redis through the vLLM connector in server mode: the scheduler's lookup
leases the hit on ``kvdepot server`` and starts its promotion, the worker's RETRIEVE goes at once
(the server holds it until the promotion is done: ``RemoteEngine`` loads asynchronously) and is
reported in ``finished_recving`` when answered. A server that goes away between lookup and load
leaves every promised block in the load errors."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from test_vllm_lower_tiers import (
    BPC,
    FAILED_CHUNK,
    HIT,
    IDS_A,
    IDS_B,
    NUM_BLOCKS,
    PROMPT,
    ask,
    assert_blocks_equal,
    hold_promotions,
    load_promoted_hit,
    redis_corrupt,
    wait_loaded,
)
from test_vllm_server_mode import figures
from vllm_helpers import SKIP_REASON, VLLM_MISSING
from vllm_rig import CHUNK, B, Rig, blocks, empty_step, new_step, request, serve_miss

from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.server.server import DepotServer

pytestmark = [pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON), pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def vllm_imported() -> None:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401


@pytest.fixture
def servers(redis_server):
    """Start kvdepot servers over one Redis (each with an empty host tier); all stopped at teardown."""
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # an ipc:// path must be short
    started: list[DepotServer] = []

    def start() -> DepotServer:
        config = load_config(chunk_size=CHUNK, host_capacity_gb=0.01, remote_url=redis_server.url, write_queue_depth=64)
        started.append(DepotServer(f"ipc://{path}/s{len(started)}.sock", config).start())
        return started[-1]

    yield start
    for srv in started:
        srv.stop()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rigs(tmp_path):
    made: list[Rig] = []

    def make(name: str, url: str, **kw) -> Rig:
        (tmp_path / name).mkdir()
        made.append(Rig(tmp_path / name, backend="mp", server_url=url, server_timeout_s=1.0, num_blocks=NUM_BLOCKS, **kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def stored_through(servers, rigs) -> Rig:
    """Another vLLM instance stores PROMPT through its server, which then stops (write-behind drained)."""
    first_server = servers()
    first = rigs("a", first_server.url, seed=1)
    serve_miss(first, "a", PROMPT, IDS_A)
    first_server.stop()
    return first


def shard_engine(server: DepotServer) -> CacheEngine:
    [group] = server.service.registry.groups()
    return group.shards[0].engine


def test_a_fresh_server_serves_the_first_request_from_redis(servers, rigs) -> None:
    a = stored_through(servers, rigs)
    server = servers()
    b = rigs("b", server.url, seed=2, policy="recompute")
    gate = hold_promotions(shard_engine(server))
    req = ask(b)  # the worker's RETRIEVE is sent in this step; the server holds it for the promotion
    time.sleep(0.05)
    assert b.worker.get_finished(set()) == (None, None)  # still loading: vLLM keeps stepping
    gate.set()
    assert wait_loaded(b) == set()
    assert_blocks_equal(b, a, HIT // B)
    b.step(new_step("r", IDS_B, HIT, len(PROMPT) - HIT), computed_blocks=IDS_B[HIT // B :])
    b.sched.request_finished(req, IDS_B)
    b.worker.get_finished({"r"})
    shard = next(iter(figures(server.url).values()))
    assert shard["loaded_chunks"] == HIT // CHUNK
    assert shard["live_leases"] == 0 and shard["pinned_chunks"] == 0


def test_a_chunk_corrupted_in_redis_before_the_servers_promotion_is_recomputed_from_there(
        servers, rigs, redis_server) -> None:
    a = stored_through(servers, rigs)
    server = servers()
    b = rigs("b", server.url, seed=2, policy="recompute")
    eng = shard_engine(server)
    gate = hold_promotions(eng)
    req = ask(b)
    redis_corrupt(redis_server, eng.lower.remote.redis_key(eng.chunk_keys(PROMPT)[FAILED_CHUNK]))
    gate.set()
    assert wait_loaded(b) == set(IDS_B[FAILED_CHUNK * BPC : HIT // B])
    assert_blocks_equal(b, a, FAILED_CHUNK * BPC)
    b.sched.request_finished(req, IDS_B)
    b.worker.get_finished({"r"})
    shard = next(iter(figures(server.url).values()))
    assert shard["live_leases"] == 0 and shard["pinned_chunks"] == 0


def test_under_the_fail_policy_the_lookup_waits_for_the_servers_promotion(servers, rigs) -> None:
    a = stored_through(servers, rigs)
    server = servers()
    b = rigs("b", server.url, seed=2)  # kv_load_failure_policy: fail
    gate = hold_promotions(shard_engine(server))
    req = request("r", PROMPT)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    gate.set()
    load_promoted_hit(b, a, req)
    shard = next(iter(figures(server.url).values()))
    assert shard["live_leases"] == 0 and shard["pinned_chunks"] == 0


def test_a_server_gone_between_lookup_and_load_reports_every_block(servers, rigs) -> None:
    stored_through(servers, rigs)
    server = servers()
    b = rigs("b", server.url, seed=2, policy="recompute")
    req = request("r", PROMPT)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (HIT, True)
    b.sched.update_state_after_alloc(req, blocks(IDS_B), HIT)
    server.stop()  # a restart loses the lease and the promotion with the host tier
    b.step(empty_step())
    assert wait_loaded(b) == set(IDS_B[: HIT // B])  # vLLM recomputes the whole prompt
    b.sched.request_finished(req, IDS_B)
    b.worker.get_finished({"r"})
