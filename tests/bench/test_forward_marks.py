"""``ForwardMarks``: a mark after every layer's wait of every forward, on the clock that can tell,
and the engine left as it was."""

from __future__ import annotations

import time

import pytest

from kvdepot.bench.forward_marks import ForwardMarks
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs


class _SlowLayerWaits:
    """A connector manager's layer hooks, with ``wait_for_layer_load`` of layer ``slow`` sleeping."""

    def __init__(self, real, slow: int, seconds: float) -> None:
        self.real, self.slow, self.seconds = real, slow, seconds

    def __call__(self, stream):
        pre, post = self.real(stream)

        def waiting(i: int) -> None:
            if i == self.slow:
                time.sleep(self.seconds)
            pre(i)

        return waiting, post


@pytest.fixture
def engine(kvdepot_env_cleared: None):
    from kvdepot.integrations.tensorrt_llm.providers import destroy_engine
    from kvdepot.runtime import KvCacheConnectorConfig

    names = dict(connector_module="kvdepot.integrations.tensorrt_llm.adapter",
                 connector_scheduler_class="KvDepotConnectorScheduler", connector_worker_class="KvDepotConnectorWorker")
    args = TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=1024), kv_connector_config=KvCacheConnectorConfig(**names))
    destroy_engine()
    yield Engine("tiny", llm_args=args)
    destroy_engine()


def test_marks_split_the_last_forward_at_its_start_and_at_layer_0s_wait(engine, monkeypatch):
    monkeypatch.setattr(engine.connector, "layer_hooks", _SlowLayerWaits(engine.connector.layer_hooks, 0, 0.05))
    run_model, hooks = engine._run_model, engine.connector.layer_hooks
    with ForwardMarks(engine) as marks:
        engine.generate([list(range(1, 80))], 1)
    assert engine._run_model == run_model and engine.connector.layer_hooks is hooks  # put back
    assert marks.forwards == 1 and marks._last.layer0 is not None  # one mark past layer 0's wait
    split = marks.split()
    assert split["to layer 0 ms"] >= 50  # the slow wait is before layer 0's mark
    assert split["to layer 0 ms"] <= split["forward ms"]
    assert 0 < split["before ms"] < 50


def test_a_block_without_a_forward_says_so(engine):
    with ForwardMarks(engine) as marks:
        pass
    with pytest.raises(RuntimeError, match="no forward"):
        marks.split()


def test_pace_counts_the_layers_a_waiting_host_paced(engine, monkeypatch):
    # On CPU a forward runs as the host issues it, so every layer past the first is host-paced,
    # and the host's slow wait before layer 1 is the device's step from layer 0 to layer 1.
    monkeypatch.setattr(engine.connector, "layer_hooks", _SlowLayerWaits(engine.connector.layer_hooks, 1, 0.05))
    with ForwardMarks(engine) as marks:
        engine.generate([list(range(1, 80))], 1)
    layers = len(marks._last.layers)
    assert layers == engine.model.config.num_layers == 2  # tiny: one step, the slow one
    pace = marks.pace()
    assert pace["host-paced layers"] == layers - 1
    assert 50 <= pace["ms/layer"] <= marks.split()["forward ms"]
