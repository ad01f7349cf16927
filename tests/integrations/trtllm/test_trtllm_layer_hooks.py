"""``LayerHooks`` alone: when the TensorRT-LLM worker may load by layer, and what a forward that
does not wait for every layer of a layered load leads to. Scripted forwards over a recording
``LayerWaits``; the worker driven through the reference runtime is test_trtllm_layered.py's."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvdepot.integrations.tensorrt_llm.layer_hooks import LayerHooks
from kvdepot.transfer.layered import LayerWaits, TransferFailed

LAYERS = 4
STREAM = object()


class Waits(LayerWaits):
    """Records each wait as (layer, stream); ``fail``: every wait raises, as after a failed enqueue."""

    def __init__(self, log: list, fail: bool = False) -> None:
        super().__init__(LAYERS)
        self.log, self.fail = log, fail

    def _wait(self, layer: int, stream: Any) -> None:
        if self.fail:
            raise TransferFailed("enqueue failed")
        self.log.append((layer, stream))


def forward(hooks: LayerHooks, layers: Any = range(LAYERS), loads: tuple[LayerWaits, ...] = ()) -> None:
    """One forward: its layered loads, the hooks in the given order, then wait_for_save."""
    for load in loads:
        hooks.add(load)
    for layer in layers:
        hooks.wait_layer(layer, STREAM)
    hooks.end_forward(STREAM, LAYERS)


def test_not_allowed_until_a_whole_forward_fired_every_hook_in_order() -> None:
    hooks = LayerHooks()
    assert not hooks.allowed
    forward(hooks, layers=[])  # a CUDA-graph replay: no hook at all
    assert not hooks.allowed
    forward(hooks, layers=[0, 1, 2])  # one layer short
    assert not hooks.allowed
    forward(hooks, layers=[0, 2, 1, 3])  # out of order
    assert not hooks.allowed
    forward(hooks, layers=[0, 1, 0, 1, 2])  # started over, never reached the last layer
    assert not hooks.allowed
    forward(hooks)
    assert hooks.allowed


def test_draft_layers_after_the_pools_do_not_hide_the_hooks() -> None:
    hooks = LayerHooks()
    forward(hooks, layers=range(LAYERS + 2))  # an MTP draft's layers are numbered after the target's
    assert hooks.allowed


def test_the_pool_unknown_counts_nothing() -> None:
    hooks = LayerHooks()
    for layer in range(LAYERS):
        hooks.wait_layer(layer, STREAM)
    hooks.end_forward(STREAM, None)
    assert not hooks.allowed


def test_a_forward_that_waits_every_layer_settles_without_a_whole_wait(caplog: pytest.LogCaptureFixture) -> None:
    hooks, log = LayerHooks(), []
    forward(hooks)
    with caplog.at_level(logging.ERROR, logger="kvdepot"):
        forward(hooks, loads=(Waits(log), Waits(log)))
    assert log == [(layer, STREAM) for layer in range(LAYERS) for _ in range(2)]
    assert hooks.allowed and not caplog.text


def test_a_skipped_layer_is_waited_wholly_logged_once_and_turns_layered_loads_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks, log = LayerHooks(), []
    forward(hooks)
    with caplog.at_level(logging.ERROR, logger="kvdepot"):
        forward(hooks, layers=[0, 2, 3], loads=(Waits(log),))
        assert log[-1] == (LAYERS - 1, STREAM) and len(log) == 4  # 0, 2, 3 then the whole load
        assert not hooks.allowed
        forward(hooks, layers=[0], loads=(Waits(log),))  # one still in flight when it turned off
    assert caplog.text.count("not all waited for") == 1
    forward(hooks)
    assert not hooks.allowed  # for good


def test_settle_before_a_forward_waits_wholly_for_a_load_no_forward_read() -> None:
    """start_load_kv settles what a previous step left (a forward that never came)."""
    hooks, log = LayerHooks(), []
    forward(hooks)
    hooks.add(Waits(log))
    hooks.settle(STREAM)
    assert log == [(LAYERS - 1, STREAM)] and not hooks.allowed
    hooks.settle(STREAM)
    assert log == [(LAYERS - 1, STREAM)]  # settled loads are dropped


def test_a_failed_load_raises_after_the_others_are_waited(caplog: pytest.LogCaptureFixture) -> None:
    hooks, log = LayerHooks(), []
    forward(hooks)
    hooks.add(Waits(log, fail=True))
    hooks.add(Waits(log))
    for layer in range(LAYERS):
        with pytest.raises(TransferFailed):
            hooks.wait_layer(layer, STREAM)
    assert log == [(layer, STREAM) for layer in range(LAYERS)]  # the good load was still waited for
    with caplog.at_level(logging.ERROR, logger="kvdepot"):
        hooks.end_forward(STREAM, LAYERS)
    # The failed load was reported by its raise; it is no missed hook, so layers stay on.
    assert hooks.allowed and not caplog.text


def test_a_layered_load_that_fails_in_the_forward_stops_the_loop_at_the_next_call_outside_it() -> None:
    """A layer that never arrived (server mode: the server could not copy it) must fail the forward,
    and 1.2 then stores the failed requests' blocks for device reuse; the worker ends the loop at the
    next call outside the forward (``get_finished``), before another step could reuse them."""
    from kvdepot.errors import PromisedLoadFailed
    from kvdepot.integrations.tensorrt_llm.adapter import KvDepotConnectorWorker
    from kvdepot.runtime import TorchLlmArgs

    worker = KvDepotConnectorWorker(TorchLlmArgs())
    worker._hooks.add(Waits([], fail=True))
    with pytest.raises(TransferFailed):
        worker.wait_for_layer_load(0, STREAM)
    assert worker.stats.failed_promises == 1
    with pytest.raises(PromisedLoadFailed, match="layer 0"):
        worker.get_finished([], [])
    with pytest.raises(PromisedLoadFailed):
        worker.start_load_kv(STREAM)
