"""The runtime on CUDA: same numerics as CPU, 1.2's two streams for the connector, a Llama-1B shape,
and a mutation test: a worker that waits for a layered load on the wrong stream is caught."""

from __future__ import annotations

import pytest
import torch
from runtime_fakes import BlockStore, Script, make_block_store_connector, make_recording_connector

from kvdepot.runtime import Engine, KvCacheConfig, LlamaModel, ModelConfig, Segment, TorchLlmArgs
from kvdepot.runtime.weights import LlamaWeights, random_weights

pytestmark = pytest.mark.gpu


def _args(max_tokens: int = 4096, **kw) -> TorchLlmArgs:
    return TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=max_tokens), **kw)


def _prompt(n: int, vocab: int = 500) -> list[int]:
    return [(7 + 13 * i) % vocab + 1 for i in range(n)]


def test_cuda_forward_matches_cpu():
    config = ModelConfig.preset("tiny")
    w = random_weights(config, seed=0, device="cuda")
    cpu = LlamaWeights(w.embed.cpu(), [type(lw)(**{k: v.cpu() for k, v in vars(lw).items()})
                                       for lw in w.layers], w.norm.cpu(), w.lm_head.cpu())
    tokens, blocks = _prompt(45), [3, 0, 2]
    outs = []
    for model in (LlamaModel(config, w), LlamaModel(config, cpu)):
        pool = torch.zeros(model.pool_shape(4, 16), device=model.device)
        first = model.forward([Segment(tokens[:20], 0, blocks)], pool, all_logits=True)[0]
        rest = model.forward([Segment(tokens[20:], 20, blocks)], pool, all_logits=True)[0]
        outs.append(torch.cat([first, rest]).cpu())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=1e-3)


def test_cuda_engine_passes_the_outer_and_the_execution_stream_as_1_2_does():
    script = Script()
    engine = Engine("tiny", device="cuda", llm_args=_args(), connector=make_recording_connector(script))
    engine.generate([_prompt(40)], 3)
    outer = torch.cuda.current_stream()
    # start_load_kv and wait_for_save: the outer stream; the layer hooks: the forward's own stream.
    assert script.streams and all(s == outer for s in script.streams)
    assert script.layer_streams and all(s == engine.execution_stream for s in script.layer_streams)
    assert engine.execution_stream != outer
    assert engine.pool.is_cuda and script.count("register_kv_caches") == 1


# ~0.5 s on an H200: the forward is long done if it does not wait. (With 0.1 s the mutant passed
# now and then within the full GPU suite, never alone; a longer delay is the first remedy tried.)
SLEEP_CYCLES = 1_000_000_000


@pytest.mark.parametrize("wrong_stream", [False, True])
def test_a_layered_load_waited_on_the_wrong_stream_is_caught(monkeypatch, kvdepot_env_cleared, wrong_stream):
    """Mutation test. kvdepot's worker loads a hit layer by layer; the copies are delayed on their
    side stream. Waited for on the hook's (execution) stream, the hit equals a run without kvdepot
    bit for bit; the mutant waits on the outer stream it got in start_load_kv, which the forward
    stopped watching when it began, so its layers read the blocks' stale KV: the outputs differ.
    (With one stream for every hook, as the runtime had, the mutant was indistinguishable.)"""
    import kvdepot.engine_loads
    from kvdepot.integrations.tensorrt_llm.adapter import (
        KvDepotConnectorScheduler,
        KvDepotConnectorWorker,
    )
    from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine
    from kvdepot.transfer.layered import LayeredLoad

    monkeypatch.setattr(kvdepot.engine_loads, "LAYER_PART_MIN_BYTES", 0)  # the tiny model's layer parts pass
    monkeypatch.setenv("KVDEPOT_LOAD_BY_LAYER", "auto")
    monkeypatch.setenv("KVDEPOT_CHUNK_SIZE", "64")
    issue = LayeredLoad.issue_through

    def slow_issue(self, count):
        if self.issued == 0:
            with torch.cuda.stream(self._side):
                torch.cuda._sleep(SLEEP_CYCLES)
        issue(self, count)

    monkeypatch.setattr(LayeredLoad, "issue_through", slow_issue)

    class WrongStreamWorker(KvDepotConnectorWorker):
        def start_load_kv(self, stream):
            self._outer = stream
            super().start_load_kv(stream)

        def wait_for_layer_load(self, layer_idx, stream):
            super().wait_for_layer_load(layer_idx, self._outer)

    worker = WrongStreamWorker if wrong_stream else KvDepotConnectorWorker
    a, filler = _prompt(1100, 500), [(3 + 11 * i) % 499 + 1 for i in range(1152 - 4 + 1)]
    destroy_engine()
    try:
        plain = Engine("tiny", device="cuda", llm_args=_args(1152), seed=0)
        plain.generate([a], 4)
        baseline = plain.generate([a], 4)[0]  # a device hit: the same forward over the same KV
        assert baseline.num_device_reused_tokens == 1088
        eng = Engine("tiny", device="cuda", llm_args=_args(1152), seed=0,
                     connector=(KvDepotConnectorScheduler, worker))
        eng.generate([a], 4)
        eng.generate([filler], 4)  # evicts `a` from the engine's pool, leaving its KV in those blocks
        hit = eng.generate([a], 4)[0]
        assert hit.num_connector_matched_tokens == 1088 and hit.num_device_reused_tokens == 0
        assert current_engine().stats().layered_loads
        same = hit.output_ids == baseline.output_ids and all(
            torch.equal(x, y) for x, y in zip(hit.logits, baseline.logits, strict=True))
        assert same != wrong_stream
    finally:
        destroy_engine()


@pytest.mark.parametrize("load_async", [False, True])
def test_cuda_block_store_round_trip(load_async):
    store = BlockStore(load_async=load_async)
    connector = make_block_store_connector(store)
    prompt = _prompt(100)
    ref = Engine("tiny", device="cuda", llm_args=_args(), seed=1).generate([prompt], 4)[0]
    Engine("tiny", device="cuda", llm_args=_args(), connector=connector, seed=1).generate([prompt], 4)
    got = Engine("tiny", device="cuda", llm_args=_args(), connector=connector, seed=1).generate([prompt], 4)[0]
    assert got.num_connector_matched_tokens == 96 and got.output_ids == ref.output_ids
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-3, rtol=1e-3)


def test_llama_1b_shape_with_reuse_in_bf16():
    engine = Engine("llama-1b", device="cuda", llm_args=_args(max_tokens=8192, max_num_tokens=1024))
    prompt = _prompt(2000, 128000)
    cold = engine.generate([prompt], 4)[0]
    warm = engine.generate([prompt], 4)[0]
    assert warm.num_device_reused_tokens == 1984
    torch.testing.assert_close(warm.logits[0], cold.logits[0], atol=0.15, rtol=0.05)
    print(f"llama-1b bf16 TTFT cold {cold.ttft_s * 1e3:.1f} ms, warm {warm.ttft_s * 1e3:.1f} ms")


def test_cuda_engine_warms_up_before_the_pool_is_registered_and_leaves_it_zeroed():
    script = Script()
    engine = Engine("tiny", device="cuda", llm_args=_args(), connector=make_recording_connector(script))
    assert script.names() == ["register_forward_pass_callable", "register_kv_caches"]
    assert not engine.pool.any()
    cold = Engine("tiny", device="cuda", llm_args=_args(), warmup=False)
    prompts = [_prompt(70), _prompt(33)[::-1]]
    for a, b in zip(engine.generate(prompts, 3), cold.generate(prompts, 3), strict=True):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
