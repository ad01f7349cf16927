"""Tensor parallel 2 in server mode: two rank processes, each with its own pool shard, one ``kvdepot server``.

Llama: each rank's pool holds its half of the KV heads, the server keeps a copy per rank, and a
chunk counts only where both ranks hold it. MLA: the latent is the same on every rank, so the
server keeps one copy per chunk and loads it into both ranks' pools. Every hit must give the
device hit's logits bit for bit on both ranks; a fault between lookup and load must never give
other KV (the lookup's pins hold the chunk, or the request recomputes).
"""

from __future__ import annotations

import threading

import pytest
import torch
from tp_ranks import CHUNK, TPB, scenario

from kvdepot.bench.server_proc import running_server
from kvdepot.runtime.model import Segment
from kvdepot.runtime.tp import TpGroup, launch, shard_model
from kvdepot.runtime.weights import build_model

FULL = (0, 320)  # (device reused, connector matched) of a whole kvdepot hit
DEVICE = (320, 0)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def server_url():
    with running_server("--chunk-size", str(CHUNK), "--host-capacity-gb", "0.01") as url:
        yield url


def _exact_hit(rank: dict) -> None:
    assert rank["miss"] == (0, 0) and rank["hit"] == FULL and rank["device"] == DEVICE, rank
    assert rank["loaded_is_saved"], f"rank {rank['rank']}: the loaded blocks are not the stored bytes"
    assert rank["hit_logits_are_device_logits"], f"rank {rank['rank']}: hit logits differ from the device hit's"
    miss, hit, device = rank["outputs"]
    assert miss == hit == device


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_llama_hit_is_the_device_hit_on_both_ranks(server_url, device):
    ranks = launch(scenario, 2, server_url, "tiny", "plain", "auto", device)
    for rank in ranks:
        _exact_hit(rank)
        assert rank["pool_shape"] == (11, 2, 2, 1 * TPB * 16)  # tiny has 2 KV heads of 16: one per rank
    # Each rank's shard holds its own heads, and the server a copy per rank.
    assert ranks[0]["saved_kv"] != ranks[1]["saved_kv"]
    assert [(r, b > 0) for r, b, _ in ranks[0]["shards"]] == [(0, True), (1, True)]


def test_tp2_chunk_held_by_one_rank_only_is_not_a_hit(server_url):
    ranks = launch(scenario, 2, server_url, "tiny", "drop")  # rank 1's saves never reach the server
    for rank in ranks:
        assert rank["hit"] == (0, 0) and rank["device"] == DEVICE, rank
        assert rank["hit_logits_are_miss_logits"]  # recomputed: the miss's forward again
    (_, rank0_bytes, _), (_, rank1_bytes, _) = ranks[0]["shards"]
    assert rank0_bytes > 0 and rank1_bytes == 0


@pytest.mark.parametrize(("copies", "device"), [("auto", "cpu"), pytest.param("per-rank", "cpu", marks=pytest.mark.slow),
                                               pytest.param("auto", "cuda", marks=pytest.mark.gpu)])
def test_tp2_mla_one_copy_per_chunk_loaded_into_both_pools(server_url, copies, device):
    ranks = launch(scenario, 2, server_url, "mla-tiny", "plain", copies, device)
    for rank in ranks:
        _exact_hit(rank)
        assert rank["pool_shape"] == (11, 2, 1, TPB * 576)  # the whole latent on every rank
    assert ranks[0]["saved_kv"] == ranks[1]["saved_kv"]  # the latent is the same on both
    chunk_bytes = 2 * 576 * CHUNK * 4  # layers x latent x tokens x fp32, one rank
    shards = ranks[0]["shards"]
    if copies == "auto":  # kv_factor 1: one copy for both ranks
        assert [(r, b) for r, b, _ in shards] == [(0, 10 * chunk_bytes)]  # A and the filler, 5 chunks each
    else:
        assert [(r, b) for r, b, _ in shards] == [(0, 10 * chunk_bytes), (1, 10 * chunk_bytes)]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "mla-tiny"])
def test_tp2_flood_between_lookup_and_load_keeps_the_pinned_copy(server_url, model):
    """Rank 1 fills the server's host memory (3x its capacity) after rank 0's lookup, before its
    own load: its copy (Llama) or the one shared copy (MLA) is pinned by the lookup and stays."""
    ranks = launch(scenario, 2, server_url, model, "flood")
    for rank in ranks:
        _exact_hit(rank)
    assert ranks[1]["flooded"] > 0
    flooded_shard = ranks[0]["shards"][-1]  # rank 1's (Llama) or the one shared shard (MLA)
    assert flooded_shard[2] > 0, "the flood evicted nothing: it tested nothing"


# ---- sharding, in one process: two threads stand in for the ranks' all-reduce ------------------
class _ThreadSum:
    """A 2-rank all-reduce between two threads (sums in rank order, as gloo's 2-rank ring does)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor | None] = [None, None]
        self.barrier = threading.Barrier(2)

    def group(self, rank: int):  # type: ignore[no-untyped-def]
        tp = TpGroup(rank, 2)

        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = self.parts[0] + self.parts[1]  # type: ignore[operator]
            self.barrier.wait()
            return total

        object.__setattr__(tp, "all_reduce", reduce)
        return tp


@pytest.mark.parametrize("name", ["tiny", "mla-tiny"])
def test_sharded_forward_matches_the_whole_model(name):
    model, _ = build_model(name, torch.device("cpu"), 0)
    tokens = [(7 * i + 3) % 500 + 1 for i in range(40)]
    pool = torch.zeros(model.pool_shape(4, 16))
    whole = model.forward([Segment(tokens, 0, [0, 1, 2])], pool)[0]
    summer, out = _ThreadSum(), [None, None]

    def rank(r: int) -> None:
        shard = shard_model(model, summer.group(r))
        out[r] = shard.forward([Segment(tokens, 0, [0, 1, 2])], torch.zeros(shard.pool_shape(4, 16)))[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(out[0], out[1])
    torch.testing.assert_close(out[0], whole, atol=1e-5, rtol=1e-4)


def test_tensor_parallel_needs_its_rank_processes():
    from kvdepot.runtime import Engine, TorchLlmArgs

    with pytest.raises(NotImplementedError, match="rank processes"):
        Engine("tiny", llm_args=TorchLlmArgs(tensor_parallel_size=2))
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size"):
        Engine("tiny", llm_args=TorchLlmArgs(pipeline_parallel_size=2))


def test_tensor_parallel_must_divide_the_heads():
    from kvdepot.errors import ConfigError

    model, _ = build_model("tiny", torch.device("cpu"), 0)  # 2 KV heads
    with pytest.raises(ConfigError, match="num_kv_heads=2"):
        shard_model(model, TpGroup(0, 4))
