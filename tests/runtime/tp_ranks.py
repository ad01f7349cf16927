"""What each TP rank process runs in the tensor-parallel tests (``runtime.tp.launch`` targets).

One prompt A of 321 tokens (320 = 10 blocks = 5 chunks reusable): a miss saves it, a filler evicts
it from the engine's pool, A again loads from ``kvdepot server``, and A once more finds it on the
device. Each rank reports what it saw; the test asserts (a rank process cannot fail a test itself).
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

import torch

from kvdepot.integrations.tensorrt_llm import mp_adapter, providers
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs
from kvdepot.runtime.tp import TpGroup

TPB, CHUNK, POOL_TOKENS, NEW = 32, 64, 352, 4


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i * i + 3 * i) % 509 + 1 for i in range(n)]


class _Recording(mp_adapter.KvDepotMPConnectorScheduler):
    """Rank 0's scheduler, keeping each request's prompt blocks (the same on every rank)."""

    blocks: dict[int, list[int]] = {}

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        _Recording.blocks[request.py_request_id] = list(block_ids)
        super().update_state_after_alloc(request, block_ids)


class _DropsSaves(mp_adapter.KvDepotMPConnectorWorker):
    """A rank whose stores of the first request never reach the server: its chunks stay one rank's."""

    def wait_for_save(self, stream: Any) -> None:
        super().wait_for_save(stream)
        self._pending_saves.clear()


class _FloodsBeforeLoad(mp_adapter.KvDepotMPConnectorWorker):
    """Between rank 0's lookup and this rank's load, fill the server's host memory with other chunks:
    every unpinned chunk of this rank's copy (or the one shared copy) is evicted."""

    flooded = 0

    def start_load_kv(self, stream: Any) -> None:
        meta, engine = self._meta(), self._engine
        if meta is not None and engine is not None and any(r.load_num_blocks for r in meta.requests):
            bpc = engine.layout.blocks_per_chunk
            capacity = engine.granted.host_blocks // bpc  # type: ignore[union-attr]
            keys = [secrets.token_bytes(16) for _ in range(3 * capacity)]
            for i in range(0, len(keys), 4):
                engine.store(keys[i : i + 4], list(range(4 * bpc)), stream=stream).wait()
            _FloodsBeforeLoad.flooded += len(keys)
        super().start_load_kv(stream)


WORKERS = {"plain": mp_adapter.KvDepotMPConnectorWorker, "drop": _DropsSaves, "flood": _FloodsBeforeLoad}


def scenario(tp: TpGroup, url: str, model: str, injection: str = "plain", tp_kv_copies: str = "auto",
             device: str = "cpu") -> dict:
    """Miss, filler, hit, device hit on this rank; ``injection`` ("drop"/"flood") acts on rank 1.
    On ``cuda`` both ranks share the one GPU (CUDA IPC pools)."""
    os.environ.update(KVDEPOT_SERVER_URL=url, KVDEPOT_CHUNK_SIZE=str(CHUNK), KVDEPOT_TP_KV_COPIES=tp_kv_copies)
    worker = WORKERS[injection] if tp.rank == 1 else mp_adapter.KvDepotMPConnectorWorker
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=POOL_TOKENS),
                            model=f"{model}-tp{tp.size}-{injection}-{tp_kv_copies}", tensor_parallel_size=tp.size)
    eng = Engine(model, device=device, llm_args=llm_args, connector=(_Recording, worker), seed=0, tp=tp)
    deadline = time.monotonic() + 30
    while providers.current_remote() is None:
        assert time.monotonic() < deadline, "the worker never registered with the server"
        time.sleep(0.01)
    tp.all_gather(None)  # every rank registered: the server answers hits from now on
    a, filler = prompt(321, 1), prompt(POOL_TOKENS - NEW + 1, 2)
    miss = eng.generate([a], NEW)[0]
    blocks = tp.broadcast(_Recording.blocks)
    saved = eng.pool[blocks[miss.request_id][:10]].clone()
    eng.generate([filler], NEW)
    hit = eng.generate([a], NEW)[0]
    device = eng.generate([a], NEW)[0]
    blocks = tp.broadcast(_Recording.blocks)
    loaded = eng.pool[blocks[hit.request_id][:10]]
    remote = providers.current_remote()
    stats = remote.stats() if remote is not None else None
    out = {
        "rank": tp.rank, "pool_shape": tuple(eng.pool.shape),
        "miss": (miss.num_device_reused_tokens, miss.num_connector_matched_tokens),
        "hit": (hit.num_device_reused_tokens, hit.num_connector_matched_tokens),
        "device": (device.num_device_reused_tokens, device.num_connector_matched_tokens),
        "loaded_is_saved": torch.equal(loaded.view(torch.uint8), saved.view(torch.uint8)),
        "outputs": (miss.output_ids, hit.output_ids, device.output_ids),
        "hit_logits_are_device_logits": all(torch.equal(x, y) for x, y in zip(hit.logits, device.logits, strict=True)),
        "hit_logits_are_miss_logits": all(torch.equal(x, y) for x, y in zip(hit.logits, miss.logits, strict=True)),
        "saved_kv": saved.view(torch.uint8).cpu().numpy().tobytes(),  # bytes: a tensor would travel as a shared fd
        "flooded": _FloodsBeforeLoad.flooded,
        "shards": sorted((s.rank, s.figures.get("bytes_stored", 0.0), s.figures.get("evictions", 0.0))
                         for s in stats.shards if s.group.startswith(llm_args.model)) if stats else [],
    }
    providers.destroy_engine()
    return out
