"""An error raised in the forward, as TensorRT-LLM 1.2's executor answers it (reference §7.3;
docs/tensorrt-llm.md, "What 1.2 does with a failed request").

1.2 catches an exception from the forward (its layer hooks, the forward-pass callable,
``wait_for_save``) in ``_forward_step`` and ``_handle_errors`` answers **every** active request with
an error. Each is freed by ``free_resources``: C++ ``releaseBlocks`` stores its full blocks of
``tokens[:-1]`` for device reuse whatever they hold, and the connector's ``request_finished`` is
not called. With the overlap scheduler (the default) the loop then stops ("Sampling failed");
without it the loop goes on, and a later request with the same prefix reuses the stored blocks.
An exception from ``start_load_kv`` stops the loop before any request is failed or stored. The
reference runtime does the same, so that kvdepot's connector is tested against these endings:
it must never let a promise fail inside the forward (integrations/tensorrt_llm/worker.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from runtime_fakes import Script, make_recording_connector
from runtime_fakes import prompt as _prompt

from kvdepot.runtime import Engine, ExecutorStopped, KvCacheConfig, TorchLlmArgs


def _engine(script: Script, fail_in: str, fail_steps: set[int], overlap: bool = False) -> Engine:
    scheduler, worker = make_recording_connector(script)

    class Failing(worker):  # type: ignore[misc, valid-type]
        def _maybe_fail(self, where: str) -> None:
            if where == fail_in and script.count("build_connector_meta") in fail_steps:
                raise RuntimeError(f"boom in {where}")

        def start_load_kv(self, stream: Any) -> None:
            super().start_load_kv(stream)
            self._maybe_fail("start_load_kv")

        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
            super().wait_for_layer_load(layer_idx, stream)
            self._maybe_fail("wait_for_layer_load")

        def wait_for_save(self, stream: Any) -> None:
            super().wait_for_save(stream)
            self._maybe_fail("wait_for_save")

    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=4096), disable_overlap_scheduler=not overlap)
    return Engine("tiny", llm_args=llm_args, connector=(scheduler, Failing), seed=0)


@pytest.mark.parametrize("where", ["wait_for_layer_load", "wait_for_save"])
def test_forward_error_without_overlap_fails_every_request_and_stores_their_blocks(where: str) -> None:
    a, b = _prompt(100), _prompt(90, 3)
    script = Script()
    eng = _engine(script, where, {1}, overlap=False)  # step 1: both prefills fail
    free = eng.blocks.num_available()
    failed = eng.generate([a, b], 3)
    assert all(r.error == f"RuntimeError: boom in {where}" for r in failed)
    assert all(r.output_ids == [] for r in failed)
    assert script.count("request_finished") == 0  # 1.2 skips the save of an errored request
    assert eng.blocks.num_available() == free  # freed (their blocks are evictable, not held)
    # Their blocks were stored for reuse although the failed forward may not have written them:
    # the same prompt now matches on the device (all full blocks of prompt[:-1]).
    tpb = eng.tokens_per_block
    assert len(eng.blocks.match(a)[0]) == (len(a) - 1) // tpb
    reused = eng.generate([a], 1)[0]
    assert reused.error is None and reused.num_device_reused_tokens == (len(a) - 1) // tpb * tpb


@pytest.mark.parametrize("where", ["wait_for_layer_load", "wait_for_save"])
def test_forward_error_with_overlap_stops_the_loop(where: str) -> None:
    a = _prompt(100)
    script = Script()
    eng = _engine(script, where, {2}, overlap=True)  # step 2: the first decode
    with pytest.raises(ExecutorStopped, match="Sampling failed"):
        eng.generate([a], 3)


def test_start_load_kv_error_stops_the_loop_before_anything_is_failed_or_stored() -> None:
    a = _prompt(100)
    script = Script()
    eng = _engine(script, "start_load_kv", {1})
    with pytest.raises(RuntimeError, match="boom in start_load_kv"):
        eng.generate([a], 3)
    assert script.count("request_finished") == 0
    assert eng.blocks.match(a)[0] == [] and eng.results == {}  # nothing stored for reuse, nobody answered
