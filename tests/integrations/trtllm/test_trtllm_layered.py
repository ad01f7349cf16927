"""Loads by layer in the TensorRT-LLM worker: when the worker uses them, that the forward waits for
every layer in order, and what happens when a forward does not (CPU: the engine's layered load is
played by a whole load plus a record of the waits; the CUDA copies are tests/test_engine.py's and
tests/runtime/test_runtime_gpu.py's)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from test_trtllm_e2e import assert_same, engine, filler, prompt

from kvdepot.engine import CacheEngine, LayeredLoad
from kvdepot.integrations.tensorrt_llm.adapter import KvDepotConnectorWorker
from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine


class RecordedLoad(LayeredLoad):
    """A layered load whose waits are written down instead of enqueued (no CUDA here)."""

    def __init__(self, layers: int, log: list) -> None:
        super().__init__(iter(range(layers)), [_Event() for _ in range(layers)], None, lambda error: None)
        self.log = log

    def wait_layer(self, layer: int, stream: Any) -> None:
        self.log.append(("layer", layer))
        super().wait_layer(layer, _NoStream())

    def wait_all(self, stream: Any) -> None:
        self.log.append(("all", None))
        super().wait_all(_NoStream())


class _NoStream:
    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    """A CUDA event's part in a layered load: recorded once its layer is enqueued."""

    def __init__(self, log: list | None = None, name: Any = None) -> None:
        self.recorded, self.log, self.name = False, log, name

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        if self.log is not None:
            self.log.append(("recorded", self.name))


def _load(layers: int, log: list, fail_at: int | None = None) -> tuple[LayeredLoad, list]:
    """A layered load over a mover double that logs each layer it enqueues (and can fail)."""
    done: list = []

    def mover():
        for layer in range(layers):
            if layer == fail_at:
                raise RuntimeError("the driver said no")
            log.append(("enqueued", layer))
            yield layer

    events = [_Event(log, layer) for layer in range(layers)]
    return LayeredLoad(mover(), events, None, done.append), done


class _Stream:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, event: Any) -> None:
        assert event.recorded, "a stream made to wait for an event not recorded yet passes at once"
        self.log.append(("waited", event.name))

    def wait_stream(self, other: Any) -> None:  # a failed load: what was enqueued, before the blocks' next use
        self.log.append(("fenced", other))


def test_layered_load_counts_only_in_order_waits_and_ignores_foreign_layers() -> None:
    log: list = []
    load, _ = _load(3, log)
    load.wait_layer(1, _Stream(log))  # out of order: waited on, but not "in order"
    load.wait_layer(7, _Stream(log))  # not a layer of this pool (a draft model's hook): ignored
    load.wait_layer(-1, _Stream(log))
    assert [e for e in log if e[0] == "waited"] == [("waited", 1)] and not load.fully_waited
    for layer in range(3):
        load.wait_layer(layer, _Stream(log))
    assert load.fully_waited and [e for e in log if e[0] == "waited"][1:] == [("waited", i) for i in range(3)]
    other, _ = _load(3, [])
    other.wait_all(_Stream([]))
    assert other.fully_waited


def test_layered_load_enqueues_a_few_layers_ahead_of_the_waits() -> None:
    """Nothing is enqueued until asked; each wait enqueues through ``LAYERS_AHEAD`` layers past the
    one waited for, every layer's event is recorded right after its copies and before any stream
    waits for it, and the transfer hears once that every layer is enqueued."""
    from kvdepot.transfer.layered import LAYERS_AHEAD

    layers, log = LAYERS_AHEAD + 6, []
    load, done = _load(layers, log)
    assert log == [] and load.issued == 0
    load.issue_through(2)
    assert log == [("enqueued", 0), ("recorded", 0), ("enqueued", 1), ("recorded", 1)]
    for layer in range(layers):
        load.wait_layer(layer, _Stream(log))
        assert load.issued == min(layers, layer + 1 + LAYERS_AHEAD)
        assert done == ([None] if load.issued == layers else [])
    assert [e for e in log if e[0] != "waited"] == [(w, i) for i in range(layers) for w in ("enqueued", "recorded")]
    assert load.fully_waited and load.fully_issued and done == [None]


def test_layered_load_that_cannot_be_enqueued_fails_every_later_wait() -> None:
    """A mover failing at layer 3: the layers before stay waitable, the transfer hears of the
    error once, and every wait for a layer not enqueued raises ``TransferFailed`` (a forward must
    not read blocks the load never filled); ``finish`` (shutdown) does not raise."""
    from kvdepot.transfer.layered import TransferFailed

    log: list = []
    load, done = _load(8, log, fail_at=3)
    load.issue_through(3)
    assert done == []
    with pytest.raises(TransferFailed, match="after 3 layers"):
        load.wait_layer(0, _Stream(log))  # enqueues through 0 + 1 + LAYERS_AHEAD: reaches layer 3
    assert len(done) == 1 and isinstance(done[0], RuntimeError)
    for wait in (lambda: load.wait_layer(4, _Stream(log)), lambda: load.wait_all(_Stream(log))):
        with pytest.raises(TransferFailed):
            wait()
    load.finish()
    assert len(done) == 1 and not [e for e in log if e[0] == "waited"] and load.fully_issued
    assert log.count(("fenced", None)) == 3  # each failed wait made its stream wait for what went


def test_layered_load_refuses_a_mover_that_skips_a_layer() -> None:
    from kvdepot.transfer.layered import TransferFailed

    done: list = []
    load = LayeredLoad(iter([0, 2, 1]), [_Event() for _ in range(3)], None, done.append)
    with pytest.raises(TransferFailed, match="out of order"):
        load.wait_all(_Stream([]))
    assert len(done) == 1


@pytest.fixture
def layered(monkeypatch: pytest.MonkeyPatch) -> list:
    """``retrieve_by_layer`` loads whole (correct KV on CPU) and hands back a recorded load."""
    log: list = []

    def retrieve_by_layer(self: CacheEngine, keys: Any, block_ids: Any, **kw: Any) -> tuple[int, LayeredLoad]:
        log.append(("load", None))
        return self.retrieve(keys, block_ids, **kw), RecordedLoad(self.layout.num_layers, log)

    monkeypatch.setattr(CacheEngine, "retrieve_by_layer", retrieve_by_layer)
    return log


def test_hits_load_by_layer_once_the_hooks_were_seen(layered: list) -> None:
    a = prompt(1100, 1)
    baseline = engine(1152, connector=None).generate([a], 4)[0]
    eng = engine(1152)
    eng.generate([a], 4)  # no hit: the first forward shows the worker that the layer hooks fire
    assert layered == []
    eng.generate([filler(1152, 4)], 4)  # evicts A from the engine's pool
    hit = eng.generate([a], 4)[0]
    assert hit.num_connector_matched_tokens == 1024 and hit.num_device_reused_tokens == 0
    layers = eng.model.config.num_layers
    assert layered == [("load", None)] + [("layer", i) for i in range(layers)]  # each layer waited, in order
    assert_same(hit, baseline)
    assert current_engine().stats().live_leases == 0


def test_first_forward_loads_whole(layered: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that has not yet seen the hooks fire loads whole: nothing depends on them."""
    a = prompt(1100, 2)
    engine(1152).generate([a], 2)  # another engine (and worker) saved A
    hit = engine(1152).generate([a], 2)[0]  # a fresh worker's first forward is the hit
    assert hit.num_connector_matched_tokens == 1024 and layered == []


def test_a_forward_that_skips_a_layer_hook_is_caught(layered: list, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """If a forward skips a layer's wait (hooks gone missing after they were seen), the load is
    waited for wholly at wait_for_save, an error is logged, and later loads are whole."""
    a, b = prompt(1100, 3), prompt(1100, 4)
    eng = engine(1152)
    eng.generate([a], 2)
    eng.generate([b], 2)
    eng.generate([filler(1152, 2)], 2)
    original = KvDepotConnectorWorker.wait_for_layer_load

    def skip_layer_one(self: KvDepotConnectorWorker, layer_idx: int, stream: Any) -> None:
        if layer_idx != 1:
            original(self, layer_idx, stream)

    monkeypatch.setattr(KvDepotConnectorWorker, "wait_for_layer_load", skip_layer_one)
    with caplog.at_level(logging.ERROR, logger="kvdepot"):
        eng.generate([a], 2)
    assert ("all", None) in layered and "not all waited for" in caplog.text
    monkeypatch.setattr(KvDepotConnectorWorker, "wait_for_layer_load", original)
    layered.clear()
    eng.generate([filler(1152, 2, seed=98)], 2)
    hit = eng.generate([b], 2)[0]
    assert hit.num_connector_matched_tokens == 1024 and layered == []  # whole from now on


def test_load_by_layer_off(layered: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_LOAD_BY_LAYER", "off")
    a = prompt(1100, 5)
    eng = engine(1152)
    eng.generate([a], 2)
    eng.generate([filler(1152, 2)], 2)
    assert eng.generate([a], 2)[0].num_connector_matched_tokens == 1024 and layered == []


@pytest.mark.gpu
def test_cuda_hit_by_layer_equals_a_whole_load_and_no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, for real: the hit is copied layer by layer (the tiny model's 8 KiB layer parts are
    let through), each layer's attention waits for its own event, and the output is bitwise that
    of a whole load, and that of an engine without kvdepot."""
    import torch

    import kvdepot.engine_loads
    from kvdepot.integrations.tensorrt_llm.adapter import KvDepotConnectorScheduler
    from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

    monkeypatch.setattr(kvdepot.engine_loads, "LAYER_PART_MIN_BYTES", 0)

    def cuda_engine(connector: Any = (KvDepotConnectorScheduler, KvDepotConnectorWorker)) -> Engine:
        llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=1152))
        return Engine("tiny", device="cuda", llm_args=llm_args, connector=connector, seed=0)

    a = prompt(1100, 6)
    baseline = cuda_engine(connector=None).generate([a], 4)[0]
    hits = {}
    for mode in ("off", "auto"):
        destroy_engine()  # the engine singleton reads its config once
        monkeypatch.setenv("KVDEPOT_LOAD_BY_LAYER", mode)
        eng = cuda_engine()
        eng.generate([a], 4)
        eng.generate([filler(1152, 4)], 4)
        hits[mode] = eng.generate([a], 4)[0]
        assert hits[mode].num_connector_matched_tokens == 1024 and hits[mode].num_device_reused_tokens == 0
        stats = current_engine().stats()
        assert stats.layered_loads == (mode == "auto") and stats.live_leases == 0
    assert hits["auto"].output_ids == hits["off"].output_ids == baseline.output_ids
    for x, y, z in zip(hits["auto"].logits, hits["off"].logits, baseline.logits, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=1e-4, atol=1e-4)
