"""An error raised in the forward fails the step's requests with an error response (reference §7.3).

TensorRT-LLM 1.2 catches an exception from the forward (its layer hooks, the forward-pass
callable, ``wait_for_save``) and answers every active request with an error; the loop goes on.
An exception from ``start_load_kv`` or another scheduler call stops the loop. The reference
runtime must do the same, since kvdepot's worker relies on it to fail a request whose promised
load came up short.
"""

from __future__ import annotations

from typing import Any

import pytest
from runtime_fakes import Script, make_recording_connector
from runtime_fakes import prompt as _prompt

from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs


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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("where", ["wait_for_layer_load", "wait_for_save"])
def test_forward_error_fails_active_requests_and_the_loop_goes_on(where: str, overlap: bool) -> None:
    a, b = _prompt(100), _prompt(90, 3)
    reference = Engine("tiny", llm_args=TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=4096)),
                       seed=0).generate([a, b], 3)
    script = Script()
    eng = _engine(script, where, {2}, overlap)  # step 1: both prefills; step 2: their first decode
    free = eng.blocks.num_available()
    failed = eng.generate([a, b], 3)
    assert all(r.error == f"RuntimeError: boom in {where}" for r in failed)
    assert all(len(r.output_ids) == 1 for r in failed)  # the prefill's token, then the failed step
    assert script.count("request_finished") == 2  # terminated: the connector hears of both
    assert eng.blocks.num_available() == free  # their blocks went back
    again = eng.generate([a, b], 3)  # the loop goes on, and serves the same prompts right
    assert [r.error for r in again] == [None, None]
    assert [r.output_ids for r in again] == [r.output_ids for r in reference]


def test_error_in_the_first_forward_leaves_nothing_for_device_reuse() -> None:
    a = _prompt(100)
    script = Script()
    eng = _engine(script, "wait_for_layer_load", {1})
    failed = eng.generate([a], 2)[0]
    assert failed.error is not None and failed.output_ids == []
    again = eng.generate([a], 2)[0]
    assert again.error is None and again.num_device_reused_tokens == 0  # the failed prefill computed nothing


def test_error_in_start_load_kv_stops_the_loop() -> None:
    eng = _engine(Script(), "start_load_kv", {1})
    with pytest.raises(RuntimeError, match="boom in start_load_kv"):
        eng.generate([_prompt(60)], 2)
