"""The multi-process connector driven in TensorRT-LLM's call order against an in-process server."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mp_helpers import CHUNK, DTYPE, POOL_SHAPE, TOKENS_PER_BLOCK, fill, wait_for

from kvdepot.config import load_config
from kvdepot.engine import Hit
from kvdepot.integrations.tensorrt_llm import providers
from kvdepot.integrations.tensorrt_llm.api import RequestData, SchedulerOutput
from kvdepot.integrations.tensorrt_llm.metadata import KvDepotMetadata
from kvdepot.integrations.tensorrt_llm.mp_adapter import (
    KvDepotMPConnectorScheduler,
    KvDepotMPConnectorWorker,
)
from kvdepot.runtime.llm_args import KvCacheConfig, TorchLlmArgs
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer

pytestmark = pytest.mark.timeout(60)

PROMPT = [(i * 37) % 1000 for i in range(100)]  # 6 full chunks of 16, 13 blocks of 8


class Request:
    """The binding-level request TensorRT-LLM hands to get_num_new_matched_tokens."""

    def __init__(self, request_id: int, tokens: list[int]) -> None:
        self.request_id, self.prompt_len, self._tokens = request_id, len(tokens), tokens

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)


def _connector(workdir, monkeypatch, **config):
    monkeypatch.setenv("KVDEPOT_SERVER_TIMEOUT_S", "1.0")
    server = DepotServer(f"ipc://{workdir}/a.sock", load_config(chunk_size=CHUNK, **config)).start()
    monkeypatch.setenv("KVDEPOT_SERVER_URL", server.url)  # 1.2's connector config has no server_url
    args = TorchLlmArgs(model="tiny-llama", kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK))
    pool = fill(torch.zeros(POOL_SHAPE, dtype=DTYPE), 7)
    worker, scheduler = KvDepotMPConnectorWorker(args), KvDepotMPConnectorScheduler(args)
    worker.register_kv_caches(pool)
    return scheduler, worker, pool, server


@pytest.fixture
def connector(workdir, monkeypatch):
    parts = _connector(workdir, monkeypatch, host_capacity_gb=0.01)
    yield parts
    providers.destroy_engine()
    parts[3].stop()


@pytest.fixture
def disk_connector(workdir, monkeypatch):
    """Host memory for 6 chunks only, and a disk tier behind it."""
    chunk_bytes = 2 * 2 * 2 * POOL_SHAPE[3] * 2
    parts = _connector(workdir, monkeypatch, host_capacity_gb=(6 * chunk_bytes + 64) / 1e9,
                       disk_path=str(workdir / "disk"), disk_capacity_gb=0.01)
    yield parts
    providers.destroy_engine()
    parts[3].stop()


def step(scheduler, worker, new=(), cached=()) -> KvDepotMetadata:
    meta = scheduler.build_connector_meta(SchedulerOutput(list(new), list(cached)))
    worker.bind_connector_meta(meta)
    worker.start_load_kv(None)
    worker.wait_for_save(None)  # (the forward pass ran in between)
    return meta


def finish(worker, saving=(), loading=(), timeout: float = 10.0) -> tuple[set[int], set[int]]:
    """Hand ids to get_finished once (as TensorRT-LLM does), then poll until all come back."""
    saved, loaded = (set(x) for x in worker.get_finished(list(saving), list(loading)))

    def collect() -> bool:
        more = worker.get_finished([], [])
        saved.update(more[0])
        loaded.update(more[1])
        return set(saving) <= saved and set(loading) <= loaded

    assert (set(saving) <= saved and set(loading) <= loaded) or wait_for(collect, timeout)
    return saved, loaded


def save_request(scheduler, worker, rid: int, blocks: list[int]) -> None:
    assert scheduler.get_num_new_matched_tokens(Request(rid, PROMPT), 0) == (0, False)
    scheduler.update_state_after_alloc(Request(rid, PROMPT), blocks)
    step(scheduler, worker, [RequestData(rid, PROMPT, blocks, 0, len(PROMPT))])
    assert scheduler.request_finished(Request(rid, PROMPT), blocks) is True  # saves in flight
    finish(worker, saving=[rid])


def test_saved_prompt_is_loaded_bit_exact_synchronously(connector):
    scheduler, worker, pool, _ = connector
    first = list(range(13))
    save_request(scheduler, worker, 1, first)
    second = list(range(13, 26))
    matched = scheduler.get_num_new_matched_tokens(Request(2, PROMPT), 0)
    assert matched == (96, False)  # block-aligned, leaves a prompt token to compute
    scheduler.update_state_after_alloc(Request(2, PROMPT), second)
    meta = step(scheduler, worker, [RequestData(2, PROMPT, second, 0, len(PROMPT) - 96)])
    assert meta.requests[0].load_num_blocks == 12
    assert torch.equal(pool[second[:12]], pool[first[:12]])
    assert worker.get_finished([], []) == ([], [])


def test_hits_are_asked_by_layer_once_the_hooks_were_seen(connector, monkeypatch, caplog):
    """As in-process: the first forward shows the worker that the layer hooks fire; from then on
    a hit is asked of the server by layer, and where the server answers so, the forward waits for
    each layer in turn (here a bytes pool, loaded whole, stands in for a CUDA pool's answer)."""
    from kvdepot.transfer.layered import LayerWaits

    scheduler, worker, pool, _ = connector
    layers, asked, waited = POOL_SHAPE[1], [], []

    class RecordedWaits(LayerWaits):
        def _wait(self, layer, stream):
            waited.append(layer)

    inner = RemoteEngine.retrieve_async

    def retrieve_async(self, *args, by_layer=False, **kwargs):
        asked.append(by_layer)
        handle = inner(self, *args, **kwargs)
        if by_layer:
            handle.layered = RecordedWaits(layers)
        return handle

    monkeypatch.setattr(RemoteEngine, "retrieve_async", retrieve_async)

    def forward(rid, blocks, computed):
        meta = scheduler.build_connector_meta(SchedulerOutput([RequestData(rid, PROMPT, blocks, 0, computed)], []))
        worker.bind_connector_meta(meta)
        worker.start_load_kv(None)
        for layer in range(layers):
            worker.wait_for_layer_load(layer, None)
        worker.wait_for_save(None)

    first, second, third = list(range(13)), list(range(13, 26)), list(range(19, 32))
    save_request(scheduler, worker, 1, first)  # a forward without layer hooks: not seen yet
    for rid, blocks in ((2, second), (3, third)):
        assert scheduler.get_num_new_matched_tokens(Request(rid, PROMPT), 0) == (96, False)
        scheduler.update_state_after_alloc(Request(rid, PROMPT), blocks)
        forward(rid, blocks, len(PROMPT) - 96)
        assert torch.equal(pool[blocks[:12]], pool[first[:12]])
    assert asked == [False, True]  # whole before the hooks were seen, by layer after
    assert waited == list(range(layers)) and "not all waited" not in caplog.text


def test_device_prefix_and_whole_prompt_hits_stay_legal(connector):
    scheduler, worker, _, _ = connector
    save_request(scheduler, worker, 1, list(range(13)))
    assert scheduler.get_num_new_matched_tokens(Request(2, PROMPT), 3) == (0, False)  # not block-aligned
    assert scheduler.get_num_new_matched_tokens(Request(3, PROMPT), 40) == (56, False)  # 40 + 56 < 100
    exact = PROMPT[:96]  # fully cached: leave one token, at a block boundary
    assert scheduler.get_num_new_matched_tokens(Request(4, exact), 0) == (88, False)


def test_a_hit_still_being_promoted_is_waited_for_then_promised_synchronously(connector, monkeypatch):
    """TensorRT-LLM promises only bytes in host memory: a lookup whose hit is still being promoted
    waits for the promotion (``lower_tier_wait_s``), looks again, and promises what is there then."""
    scheduler, worker, pool, _ = connector
    first = list(range(13))
    save_request(scheduler, worker, 1, first)
    real_probe = RemoteEngine.probe
    probes = []

    def staging(self, *args, **kw):  # the first look finds the hit still being promoted from disk
        hit = real_probe(self, *args, **kw)
        probes.append(hit)
        return Hit(hit.tokens, 0) if len(probes) == 1 else hit

    monkeypatch.setattr(RemoteEngine, "probe", staging)
    remote = providers.current_remote()
    remote.config = dataclasses.replace(remote.config, lower_tier_hits="prefetch")
    assert scheduler.get_num_new_matched_tokens(Request(4, PROMPT), 0) == (0, False)  # prefetch: no wait
    scheduler.request_finished(Request(4, PROMPT), [])
    probes.clear()
    remote.config = dataclasses.replace(remote.config, lower_tier_hits="load")
    assert scheduler.get_num_new_matched_tokens(Request(5, PROMPT), 0) == (96, False)
    assert len(probes) == 2  # the second look, after the promotion, answered the promise
    blocks = list(range(16, 29))
    scheduler.update_state_after_alloc(Request(5, PROMPT), blocks)
    meta = step(scheduler, worker, [RequestData(5, PROMPT, blocks, 0, 4)])
    assert [r.load_num_blocks for r in meta.requests] == [12]
    assert torch.equal(pool[blocks[:12]], pool[first[:12]])
    assert worker.get_finished([], []) == ([], [])


def test_server_down_means_misses_and_skipped_saves(connector):
    scheduler, worker, _, server = connector
    server.stop()
    assert wait_for(lambda: providers.current_remote() is None, 10)
    assert scheduler.get_num_new_matched_tokens(Request(9, PROMPT), 0) == (0, False)
    blocks = list(range(13))
    scheduler.update_state_after_alloc(Request(9, PROMPT), blocks)
    step(scheduler, worker, [RequestData(9, PROMPT, blocks, 0, len(PROMPT))])
    scheduler.request_finished(Request(9, PROMPT), blocks)
    assert worker.get_finished([9], []) == ([9], [])


def _evict_to_disk(scheduler, worker, first: list[int]) -> None:
    """Save PROMPT, wait for write-behind, then push it out of host memory with another prompt."""
    remote = providers.current_remote()
    remote.prefetch_wait_s = 0  # answer from the LOOKUP alone: a fast promotion would count as a host hit
    save_request(scheduler, worker, 1, first)
    # written, and every slot given back (write-behind pins each while the disk writes it)
    assert wait_for(lambda: sum(s.figures.get("disk_chunks", 0) for s in remote.stats().shards) >= 6
                    and sum(s.figures["pinned_chunks"] for s in remote.stats().shards) == 0, 10)
    other = [(t * 13 + 5) % 1000 for t in range(100)]
    assert scheduler.get_num_new_matched_tokens(Request(2, other), 0) == (0, False)
    scheduler.update_state_after_alloc(Request(2, other), list(range(13, 26)))
    step(scheduler, worker, [RequestData(2, other, list(range(13, 26)), 0, 100)])
    assert scheduler.request_finished(Request(2, other), list(range(13, 26))) is True
    finish(worker, saving=[2])


def test_disk_hit_is_prefetched_for_later_requests_with_prefetch(disk_connector):
    scheduler, worker, pool, _ = disk_connector
    remote = providers.current_remote()
    remote.config = dataclasses.replace(remote.config, lower_tier_hits="prefetch")
    first = list(range(13))
    _evict_to_disk(scheduler, worker, first)
    assert scheduler.get_num_new_matched_tokens(Request(3, PROMPT), 0) == (0, False)  # promotion starts
    scheduler.request_finished(Request(3, PROMPT), [])
    assert wait_for(lambda: scheduler.get_num_new_matched_tokens(Request(4, PROMPT), 0) == (96, False), 10)
    blocks = list(range(16, 29))
    scheduler.update_state_after_alloc(Request(4, PROMPT), blocks)
    step(scheduler, worker, [RequestData(4, PROMPT, blocks, 0, 4)])
    assert torch.equal(pool[blocks[:12]], pool[first[:12]])


def test_disk_hit_is_read_before_it_is_promised(disk_connector):
    scheduler, worker, pool, _ = disk_connector
    remote = providers.current_remote()
    remote.config = dataclasses.replace(remote.config, lower_tier_hits="load")
    first = list(range(13))
    _evict_to_disk(scheduler, worker, first)
    matched = scheduler.get_num_new_matched_tokens(Request(3, PROMPT), 0)
    assert matched == (96, False)  # on disk only: read into host memory during the lookup, then promised
    blocks = list(range(16, 29))
    pool[blocks] = 0
    scheduler.update_state_after_alloc(Request(3, PROMPT), blocks)
    meta = step(scheduler, worker, [RequestData(3, PROMPT, blocks, 0, 4)])
    assert [r.load_num_blocks for r in meta.requests] == [12]
    assert torch.equal(pool[blocks[:12]], pool[first[:12]])