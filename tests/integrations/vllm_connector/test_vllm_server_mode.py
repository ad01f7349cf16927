"""``KvDepotConnector`` in server mode (``server_url`` set), driven like test_vllm_connector.py but
against an in-process ``DepotServer``: the scheduler and the worker each have their own
connection, as they would in vLLM's engine-core and worker processes, with the ``mp`` executor.
Real vLLM in separate processes runs in test_vllm_server_e2e.py.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from vllm_helpers import SKIP_REASON, VLLM_MISSING
from vllm_rig import CHUNK, TOKENS, Rig, blocks, new_step, request, serve_miss

from kvdepot.config import load_config
from kvdepot.server.client import DepotClient
from kvdepot.server.protocol import GetStats
from kvdepot.server.server import DepotServer

pytestmark = [pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON), pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def vllm_imported() -> None:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401


@pytest.fixture
def server():
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # an ipc:// path must be short
    srv = DepotServer(f"ipc://{path}/s.sock", load_config(chunk_size=CHUNK, host_capacity_gb=0.01)).start()
    yield srv
    srv.stop()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rigs(tmp_path):
    made: list[Rig] = []

    def make(name: str, url: str, **kw) -> Rig:
        (tmp_path / name).mkdir()
        rig = Rig(tmp_path / name, backend="mp", server_url=url, server_timeout_s=1.0, **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def figures(url: str) -> dict[str, dict[str, float]]:
    client = DepotClient(url, timeout_s=2.0, name="test")
    try:
        reply, _ = client.call(GetStats())
    finally:
        client.close()
    return {shard.group: shard.figures for shard in reply.shards}


def test_miss_then_hit_through_the_server_is_bit_exact(server, rigs) -> None:
    rig = rigs("a", server.url)
    serve_miss(rig, "a", TOKENS, [1, 2, 3, 4, 5])
    [(group, shard)] = figures(server.url).items()
    assert "tag=vllm:unknown:LBHNC" in group and shard["stored_chunks"] == 2  # kept apart from TensorRT-LLM pools
    req = request("b", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (64, False)
    rig.sched.update_state_after_alloc(req, blocks([9, 8, 7, 6, 10]), 64)
    meta = rig.step(new_step("b", [9, 8, 7, 6, 10], 64, 16), computed_blocks=[10])
    assert meta.lease_session > 0  # the worker's RETRIEVE names the scheduler's lease ...
    assert len(meta.lease_token) == 16  # ... with its token (the server refuses the load without it)
    for t in rig.caches.values():
        for src, dst in zip([1, 2, 3, 4], [9, 8, 7, 6], strict=True):
            assert torch.equal(t[dst], t[src])
    assert rig.worker.get_block_ids_with_load_errors() == set()
    assert rig.sched.request_finished(req, [9, 8, 7, 6, 10]) == (True, None)
    assert rig.worker.get_finished({"b"}) == ({"b"}, None)
    shard = next(iter(figures(server.url).values()))
    assert shard["loaded_chunks"] == 2 and shard["stored_chunks"] == 2
    assert shard["live_leases"] == 0 and shard["pinned_chunks"] == 0
    assert [e["new_matched"] for e in rig.events("lookup")] == [0, 64]


def test_the_scheduler_looks_up_only_once_it_has_the_workers_geometry(server, rigs) -> None:
    rig = rigs("a", server.url, handshake=False)
    req = request("a", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # not registered: no lookup, no plan
    rig.sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    assert rig.step(new_step("a", [1, 2, 3, 4, 5], 0, 80), computed_blocks=[1, 2, 3, 4, 5]).requests == []
    assert rig.sched.request_finished(req, []) == (False, None)
    rig.handshake()  # what vLLM's engine core does after the workers registered their caches
    serve_miss(rig, "b", TOKENS, [1, 2, 3, 4, 5])
    assert next(iter(figures(server.url).values()))["stored_chunks"] == 2


def test_a_second_vllm_instance_loads_what_the_first_stored(server, rigs) -> None:
    first = rigs("a", server.url, seed=1)
    serve_miss(first, "a", TOKENS, [1, 2, 3, 4, 5])
    second = rigs("b", server.url, seed=2)  # its own caches, its own sessions
    req = request("a", TOKENS)  # the same request id in another instance is another lease
    assert second.sched.get_num_new_matched_tokens(req, 0) == (64, False)
    second.sched.update_state_after_alloc(req, blocks([20, 21, 22, 23, 11]), 64)
    second.step(new_step("a", [20, 21, 22, 23, 11], 64, 16), computed_blocks=[11])
    for name, t in second.caches.items():
        for src, dst in zip([1, 2, 3, 4], [20, 21, 22, 23], strict=True):
            assert torch.equal(t[dst], first.caches[name][src])
    second.sched.request_finished(req, [])
    second.worker.get_finished({"a"})
    assert next(iter(figures(server.url).values()))["live_leases"] == 0


def test_without_a_server_nothing_breaks_and_a_lost_load_is_reported(server, rigs, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvdepot")
    rig = rigs("a", server.url)
    serve_miss(rig, "a", TOKENS, [1, 2, 3, 4, 5])
    req = request("b", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (64, False)
    rig.sched.update_state_after_alloc(req, blocks([9, 8, 7, 6, 10]), 64)
    server.stop()  # between the hit and its load
    rig.step(new_step("b", [9, 8, 7, 6, 10], 64, 16), computed_blocks=[10])
    assert rig.worker.get_block_ids_with_load_errors() == {9, 8, 7, 6}  # vLLM recomputes them
    assert rig.sched.request_finished(req, []) in ((True, None), (False, None))
    assert rig.worker.get_finished({"b"}) in (({"b"}, None), (None, None))
    again = request("c", TOKENS)
    assert rig.sched.get_num_new_matched_tokens(again, 0) == (0, False)  # a miss, not an error
    rig.sched.update_state_after_alloc(again, blocks([1, 2, 3, 4, 5]), 0)
    rig.step(new_step("c", [1, 2, 3, 4, 5], 0, 80), computed_blocks=[1, 2, 3, 4, 5])
    assert "unavailable" in caplog.text
