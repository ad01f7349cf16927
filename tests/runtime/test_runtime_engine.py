"""End-to-end behaviour of the engine on CPU: determinism, equivalences, and KV a connector loads."""

from __future__ import annotations

import pytest
import torch
from runtime_fakes import BlockStore, make_block_store_connector

from kvdepot.runtime import Engine, KvCacheConfig, ModelConfig, TorchLlmArgs

ATOL = 1e-4


def _args(**kw) -> TorchLlmArgs:
    kv = {k: kw.pop(k) for k in ("tokens_per_block", "max_tokens") if k in kw}
    kv.setdefault("max_tokens", 4096)
    return TorchLlmArgs(kv_cache_config=KvCacheConfig(**kv), **kw)


def _prompt(n: int, offset: int = 1) -> list[int]:
    return [(offset + 11 * i) % 500 + 3 for i in range(n)]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        for la, lb in zip(x.logits, y.logits, strict=True):
            torch.testing.assert_close(la, lb, atol=ATOL, rtol=ATOL)


def test_same_seed_same_outputs_and_other_seed_differs():
    prompts = [_prompt(40), _prompt(7, 5)]
    a = Engine("tiny", llm_args=_args(), seed=7).generate(prompts, 6)
    b = Engine("tiny", llm_args=_args(), seed=7).generate(prompts, 6)
    c = Engine("tiny", llm_args=_args(), seed=8).generate(prompts, 6)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert all(torch.equal(x, y) for x, y in zip(a[0].logits, b[0].logits, strict=True))
    assert not torch.equal(a[0].logits[0], c[0].logits[0])
    assert all(len(r.logits) == 6 and r.logits[0].shape == (512,) for r in a)
    assert all(r.ttft_s > 0 and r.latency_s >= r.ttft_s for r in a)


def test_generated_logits_match_transformers_through_decode():
    from transformers import LlamaConfig, LlamaForCausalLM

    engine = Engine("tiny", llm_args=_args(tokens_per_block=8))
    c = engine.model.config
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )).eval()
    hf.load_state_dict(dict(engine.model.weights.named_tensors()))
    prompt = _prompt(13)
    [res] = engine.generate([prompt], 9)  # decode crosses two 8-token block boundaries
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + res.output_ids[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(res.logits), ref, atol=ATOL, rtol=ATOL)
    assert res.output_ids == ref.argmax(-1).tolist()


def test_chunked_prefill_device_reuse_and_batching_do_not_change_results():
    prompts = [_prompt(100), _prompt(100)[:64] + _prompt(30, 9), _prompt(20, 4)]
    ref = [Engine("tiny", llm_args=_args()).generate([p], 5)[0] for p in prompts]
    chunked = Engine("tiny", llm_args=_args(max_num_tokens=32)).generate(prompts, 5)
    _same(chunked, ref)
    engine = Engine("tiny", llm_args=_args(tokens_per_block=16))
    sequential = engine.generate_sequential(prompts, 5)
    _same(sequential, ref)
    assert [r.num_device_reused_tokens for r in sequential] == [0, 64, 0]


def test_small_pool_queues_requests_instead_of_failing():
    engine = Engine("tiny", llm_args=_args(tokens_per_block=16, max_tokens=64))
    prompts = [_prompt(30, k) for k in range(4)]  # each needs 3 of the 4 blocks
    results = engine.generate(prompts, 10)
    _same(results, [Engine("tiny", llm_args=_args()).generate([p], 10)[0] for p in prompts])
    assert engine.blocks.num_available() == 4
    with pytest.raises(ValueError, match="exceed the pool"):
        engine.submit(_prompt(60), 10)


def test_end_id_stops_early_and_first_logits_only():
    engine = Engine("tiny", llm_args=_args())
    [full] = engine.generate([_prompt(10)], 8)
    rid = engine.submit(_prompt(10), 8, keep_all_logits=False, end_id=full.output_ids[2])
    engine.run_until_done()
    res = engine.results[rid]
    assert res.output_ids == full.output_ids[:3] and len(res.logits) == 1


@pytest.mark.parametrize("load_async", [False, True])
def test_kv_loaded_by_a_connector_is_what_later_forwards_read(load_async):
    store = BlockStore(load_async=load_async)
    connector = make_block_store_connector(store)
    prompts = [_prompt(80), _prompt(80)[:64] + _prompt(10, 2)]
    ref = Engine("tiny", llm_args=_args(), seed=3).generate(prompts, 4)
    # Engine A computes and saves full blocks, in chunks; engine B starts with an empty pool.
    saver = Engine("tiny", llm_args=_args(max_num_tokens=32), connector=connector, seed=3)
    _same(saver.generate(prompts[:1], 4), ref[:1])
    assert len(store.blocks) == 2  # 80 prompt + 3 computed decode tokens: 2 full 32-token blocks
    loader = Engine("tiny", llm_args=_args(), connector=connector, seed=3)
    got = loader.generate(prompts, 4)
    _same(got, ref)
    assert [r.num_connector_matched_tokens for r in got] == [64, 64]
    assert [r.connector_async_load for r in got] == [load_async, load_async]
    assert store.loads == 4  # two blocks per request: they are admitted in the same step

    store.corrupt_loads = True
    bad = Engine("tiny", llm_args=_args(), connector=connector, seed=3).generate(prompts[:1], 1)
    assert not torch.allclose(bad[0].logits[0], ref[0].logits[0], atol=1e-3)


def test_presets_and_custom_config():
    small = ModelConfig.preset("small")
    assert (small.num_layers, small.hidden_size) == (4, 256)
    one_b, eight_b = ModelConfig.preset("llama-1b"), ModelConfig.preset("llama-8b")
    assert (one_b.num_layers, one_b.hidden_size, one_b.num_heads, one_b.num_kv_heads,
            one_b.head_dim, one_b.intermediate_size, one_b.vocab_size) == (16, 2048, 32, 8, 64, 8192, 128256)
    assert (eight_b.num_layers, eight_b.hidden_size, eight_b.head_dim,
            eight_b.intermediate_size, eight_b.tie_word_embeddings) == (32, 4096, 128, 14336, False)
    custom = ModelConfig.preset("tiny", num_layers=1)
    engine = Engine(custom, llm_args=_args(max_tokens=256))
    assert engine.pool.shape == (8, 1, 2, 2 * 32 * 16)
    assert len(engine.generate([_prompt(5)], 2)[0].output_ids) == 2
