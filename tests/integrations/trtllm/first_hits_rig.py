"""The rig of the first-request-hit tests: engines over the reference runtime, a gate on promotions.

A *writer* engine computes prompt A (1800 tokens) and stores it; its blocks' bytes are kept. A
fresh *reader* engine (empty host tier) then asks for A: with ``lower_tier_hits: load`` its lookup
waits while the 7 chunks (1792 tokens; TensorRT-LLM leaves one token to compute) are read from
disk/Redis into host memory, and promises what arrived, synchronously (``is_async=False``).
``Gate`` runs the test's failure at the start of every promotion, on its thread, before it reads:
the failure lands between the lookup and the read (and so the promise), never after it by luck.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_trtllm_e2e import TPB, prompt

from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
)
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs
from kvdepot.runtime.executor import Result
from kvdepot.storage.manager import TierManager

PROMPT_LEN, HIT, NEW, POOL_TOKENS = 1800, 1792, 4, 2048
HIT_BLOCKS = HIT // TPB
IN_PROCESS = (KvDepotConnectorScheduler, KvDepotConnectorWorker)


@dataclass
class Rig:
    """Per-request block lists (as update_state_after_alloc saw them) and the injection."""

    blocks: dict[int, list[int]] = field(default_factory=dict)
    after_promise: Callable[[], None] | None = None  # runs once the scheduler promised a load
    promised: list[tuple[int, bool]] = field(default_factory=list)

    def classes(self, scheduler: type, worker: type) -> tuple[type, type]:
        rig = self

        class Recording(scheduler):  # type: ignore[misc, valid-type]
            def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
                out = super().get_num_new_matched_tokens(request, num_computed_tokens)
                rig.promised.append(out)
                if out[0] and rig.after_promise is not None:
                    inject, rig.after_promise = rig.after_promise, None
                    inject()
                return out

            def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
                rig.blocks[request.py_request_id] = list(block_ids)
                super().update_state_after_alloc(request, block_ids)

        return Recording, worker


def engine(rig: Rig | None, classes: tuple[type, type] = IN_PROCESS) -> Engine:
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=POOL_TOKENS))
    eng = Engine("tiny", llm_args=llm_args, connector=rig.classes(*classes) if rig else None, seed=0)
    eng.async_timeout_s = 30.0  # a load that never finishes fails the test, it does not hang it
    return eng


def prompt_a() -> list[int]:
    return prompt(PROMPT_LEN, 1600)


@dataclass
class Written:
    """What the writer computed: its result and the bytes of A's first HIT_BLOCKS blocks."""

    result: Result
    saved: torch.Tensor


def write(classes: tuple[type, type] = IN_PROCESS, ready: Callable[[], None] | None = None) -> Written:
    """The writer: A computed (a miss) and stored; ``ready`` waits for a server registration."""
    rig = Rig()
    eng = engine(rig, classes)
    if ready is not None:
        ready()
    result = eng.generate([prompt_a()], NEW)[0]
    assert result.num_connector_matched_tokens == 0  # a miss: nothing was stored before
    return Written(result, eng.pool[rig.blocks[result.request_id][:HIT_BLOCKS]].clone())


def assert_first_hit_exact(eng: Engine, rig: Rig, hit: Result, written: Written) -> None:
    """The first request was promised the whole hit (synchronously: read before the promise), its
    blocks hold the writer's bytes, and its output is the device hit's bit for bit (the same
    forward over the same KV)."""
    assert hit.error is None, hit.error
    assert (hit.num_device_reused_tokens, hit.num_connector_matched_tokens, hit.connector_async_load) == (0, HIT, False)
    loaded = eng.pool[rig.blocks[hit.request_id][:HIT_BLOCKS]]
    assert torch.equal(loaded.view(torch.uint8), written.saved.view(torch.uint8))
    device = eng.generate([prompt_a()], NEW)[0]
    assert device.num_device_reused_tokens == HIT and device.num_connector_matched_tokens == 0
    assert hit.output_ids == device.output_ids == written.result.output_ids
    assert all(torch.equal(x, y) for x, y in zip(hit.logits, device.logits, strict=True))


def assert_shorter_hit_right(eng: Engine, rig: Rig, hit: Result, written: Written, tokens: int) -> None:
    """A failure before the promise: the request was promised only the ``tokens`` read before it
    (synchronously), those blocks hold the writer's bytes, the rest was recomputed, and the
    output is the writer's (logits equal up to the different chunking's rounding)."""
    assert hit.error is None, hit.error
    assert (hit.num_device_reused_tokens, hit.num_connector_matched_tokens, hit.connector_async_load) == (0, tokens, False)
    blocks = tokens // TPB
    loaded = eng.pool[rig.blocks[hit.request_id][:blocks]]
    assert torch.equal(loaded.view(torch.uint8), written.saved[:blocks].view(torch.uint8))
    assert hit.output_ids == written.result.output_ids
    for x, y in zip(hit.logits, written.result.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


class Gate:
    """Runs ``inject`` (once) at the start of the next promotion from disk/Redis
    (``TierManager._promote``), on the promotion's thread, before it reads anything."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, inject: Callable[[], None]) -> None:
        pending = [inject]
        real = TierManager._promote

        def gated(manager: TierManager, *args: Any) -> int:
            if pending:
                pending.pop()()
            return real(manager, *args)

        monkeypatch.setattr(TierManager, "_promote", gated)


def worker_of(eng: Engine) -> Any:
    assert eng.connector is not None
    return eng.connector.worker
