"""The runtime on CUDA: same numerics as CPU, a real stream for the connector, a Llama-1B shape."""

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


def test_cuda_engine_passes_the_current_stream_and_a_cuda_pool():
    script = Script()
    engine = Engine("tiny", device="cuda", llm_args=_args(), connector=make_recording_connector(script))
    engine.generate([_prompt(40)], 3)
    assert script.streams and all(isinstance(s, torch.cuda.Stream) for s in script.streams)
    assert script.streams[0] == torch.cuda.current_stream()
    assert engine.pool.is_cuda and script.count("register_kv_caches") == 1


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
