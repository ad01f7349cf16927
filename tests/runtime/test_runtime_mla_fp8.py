"""The MLA model against HuggingFace's DeepseekV2ForCausalLM, and the FP8 KV pool's numerics.

MLA: the latent row (512 + 64) is the only thing in the ``kv_factor = 1`` pool, and a forward in
chunks through the pool gives HuggingFace's logits. FP8: the pool holds e4m3 values of K/V divided
by the scale, and attention dequantizes them (close to the full-precision pool, not equal to it).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs
from kvdepot.runtime.mla import MLA_PRESETS, MlaModel, mla_random_weights
from kvdepot.runtime.model import PRESETS, LlamaModel, Segment
from kvdepot.runtime.weights import preset_config, random_weights

B = 16


def _hf(config, weights) -> DeepseekV2ForCausalLM:
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads, q_lora_rank=None, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, first_k_dense_replace=config.num_layers, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=4096, tie_word_embeddings=False,
        attention_bias=False,
    )).eval()
    names = {"q_proj": "self_attn.q_proj", "kv_a_proj": "self_attn.kv_a_proj_with_mqa",
             "kv_a_norm": "self_attn.kv_a_layernorm", "kv_b_proj": "self_attn.kv_b_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj", "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
    state = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm,
             "lm_head.weight": weights.lm_head}
    for i, lw in enumerate(weights.layers):
        state.update({f"model.layers.{i}.{hf_name}.weight": getattr(lw, ours) for ours, hf_name in names.items()})
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    return hf


def test_mla_presets_have_deepseek_v2_lite_geometry():
    lite = MLA_PRESETS["mla-v2-lite"]
    assert (lite.num_layers, lite.num_heads, lite.kv_lora_rank, lite.qk_rope_head_dim) == (27, 16, 512, 64)
    assert lite.kv_factor == 1 and lite.head_dim == 576 and lite.dtype == torch.bfloat16
    assert lite.kv_bytes_per_token == 27 * 576 * 2  # one latent row per layer: no K/V pair
    model = MlaModel(MLA_PRESETS["mla-tiny"], mla_random_weights(MLA_PRESETS["mla-tiny"], 0))
    assert model.pool_shape(10, 32) == (10, 2, 1, 32 * 576)
    assert preset_config("mla-v2-lite-fp8").pool_dtype == torch.float8_e4m3fn


def test_mla_matches_huggingface_deepseek_v2_whole_and_in_chunks():
    config = MLA_PRESETS["mla-tiny"]
    weights = mla_random_weights(config, seed=3)
    ours = MlaModel(config, weights)
    tokens = [(11 * i + 5) % config.vocab_size for i in range(70)]
    with torch.no_grad():
        ref = _hf(config, weights)(torch.tensor([tokens])).logits[0].float()
    blocks = [4, 0, 2, 5, 1]  # 70 tokens of B=16 in scattered blocks
    pool = torch.zeros(ours.pool_shape(6, B))
    whole = ours.forward([Segment(tokens, 0, blocks)], pool, all_logits=True)[0]
    torch.testing.assert_close(whole, ref, atol=2e-5, rtol=1e-4)
    pool.zero_()
    parts = [ours.forward([Segment(tokens[a:b], a, blocks)], pool, all_logits=True)[0]
             for a, b in ((0, 33), (33, 34), (34, 70))]
    torch.testing.assert_close(torch.cat(parts), ref, atol=2e-5, rtol=1e-4)


def test_mla_pool_holds_the_normalized_latent_and_the_roped_key_only():
    config = MLA_PRESETS["mla-tiny"]
    weights = mla_random_weights(config, seed=1)
    model = MlaModel(config, weights)
    pool = torch.zeros(model.pool_shape(2, B))
    tokens = list(range(1, 11))
    model.forward([Segment(tokens, 0, [1])], pool)
    rows = pool[1, 0, 0].view(B, 576)
    assert torch.count_nonzero(rows[10:]) == 0 and torch.count_nonzero(pool[0]) == 0
    x = weights.embed[torch.tensor(tokens)]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    latent = (h @ weights.layers[0].kv_a_proj.T)[:, :512]
    latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    torch.testing.assert_close(rows[:10, :512], latent)
    torch.testing.assert_close(rows[0, 512:], (h @ weights.layers[0].kv_a_proj.T)[0, 512:])  # position 0: no rotation


def test_fp8_pool_stores_scaled_e4m3_and_attention_dequantizes():
    fp8 = PRESETS["tiny-fp8"]
    full = PRESETS["tiny"]
    assert fp8.pool_dtype == torch.float8_e4m3fn and fp8.kv_bytes_per_token * 4 == full.kv_bytes_per_token
    weights = random_weights(full, seed=2)
    tokens = [(13 * i + 1) % 500 for i in range(40)]
    logits, pools = {}, {}
    for name, config in (("fp8", fp8), ("full", full)):
        model = LlamaModel(config, weights)
        pools[name] = torch.zeros(model.pool_shape(3, B), dtype=config.pool_dtype)
        logits[name] = model.forward([Segment(tokens, 0, [2, 0, 1])], pools[name], all_logits=True)[0]
    assert pools["fp8"].dtype == torch.float8_e4m3fn
    # Layer 0 sees the same inputs in both (later layers see the quantized attention's output).
    expected = (pools["full"][:, 0].float() / fp8.kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(pools["fp8"][:, 0].view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(logits["fp8"], logits["full"])  # quantized KV is really what attention reads
    torch.testing.assert_close(logits["fp8"], logits["full"], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("name", ["tiny-fp8", "mla-tiny"])
def test_engine_allocates_the_models_pool(name):
    engine = Engine(name, llm_args=TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=512)))
    config = preset_config(name)
    assert engine.pool.dtype == config.pool_dtype and engine.pool.shape[2] == config.kv_factor
    a = engine.generate([[(7 * i) % 500 + 1 for i in range(100)]], 3)[0]
    b = engine.generate([[(7 * i) % 500 + 1 for i in range(100)]], 3)[0]
    assert b.num_device_reused_tokens == 96 and b.output_ids == a.output_ids
