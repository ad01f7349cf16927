"""The reference model against HuggingFace's LlamaForCausalLM, whole and chunked through the pool."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvdepot.runtime.model import LlamaModel, ModelConfig, RopeScaling, Segment
from kvdepot.runtime.weights import load_checkpoint, random_weights

B = 8  # tokens per block: small, so short prompts span several blocks


def _hf_model(config: ModelConfig, weights) -> LlamaForCausalLM:
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=16384, tie_word_embeddings=config.tie_word_embeddings,
    )
    hf = LlamaForCausalLM(hf_config).eval()
    state = dict(weights.named_tensors())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


def _hf_logits(hf: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _pool(model: LlamaModel, num_blocks: int) -> torch.Tensor:
    return torch.zeros(model.pool_shape(num_blocks, B), dtype=model.config.dtype)


def _chunked(model: LlamaModel, tokens: list[int], bounds: list[int], block_ids: list[int]):
    pool = _pool(model, max(block_ids) + 1)
    out = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        seg = Segment(tokens[start:end], start, block_ids)
        out.append(model.forward([seg], pool, all_logits=True)[0])
    return torch.cat(out), pool


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True},
     {"rope_theta": 500000.0, "rope_scaling": RopeScaling(8.0, 1.0, 4.0, 16)}],
    ids=["untied", "tied", "llama3-rope"],
)
def test_forward_matches_transformers_whole_and_chunked(overrides):
    config = ModelConfig.preset("tiny", **overrides)
    weights = random_weights(config, seed=3)
    model, hf = LlamaModel(config, weights), _hf_model(config, weights)
    tokens = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _hf_logits(hf, tokens)
    # Scattered, out-of-order block ids: the pool must be addressed through the block table.
    block_ids = [9, 2, 7, 0, 5]
    whole, _ = _chunked(model, tokens, [0, 37], block_ids)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    chunked, _ = _chunked(model, tokens, [0, 16, 17, 30, 37], block_ids)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


def test_pool_layout_is_hnd_and_later_forwards_read_it():
    config = ModelConfig.preset("tiny")
    model = LlamaModel(config, random_weights(config, seed=0))
    tokens = list(range(1, 21))
    _, pool = _chunked(model, tokens, [0, 20], [4, 1, 6])
    # Token 9 lives in block_ids[1] = 1 at offset 1; its K for head h is pool[1, l, 0][h, 1, :].
    row = pool[1, 0, 0].view(config.num_kv_heads, B, config.head_dim)
    assert row[:, 1].abs().sum() > 0 and row[:, 4:].abs().sum() > 0
    assert pool[6, 0, 0].view(config.num_kv_heads, B, config.head_dim)[:, 4:].abs().sum() == 0
    # A decode step that only brings the last token sees the earlier ones through the pool.
    last = model.forward([Segment(tokens[19:], 19, [4, 1, 6])], pool)[0]
    ref = _chunked(model, tokens, [0, 20], [4, 1, 6])[0][-1]
    torch.testing.assert_close(last, ref, atol=1e-5, rtol=1e-5)
    # Corrupting a cached block changes the answer: attention really reads the pool.
    pool[4].zero_()
    assert not torch.allclose(model.forward([Segment(tokens[19:], 19, [4, 1, 6])], pool)[0], ref)


def test_batched_segments_equal_separate_forwards():
    config = ModelConfig.preset("tiny")
    model = LlamaModel(config, random_weights(config, seed=0))
    a, b = list(range(5, 30)), list(range(100, 111))
    pool = _pool(model, 8)
    batched = model.forward([Segment(a, 0, [0, 1, 2, 3]), Segment(b, 0, [4, 5])], pool)
    sep_a = _chunked(model, a, [0, 25], [0, 1, 2, 3])[0][-1]
    sep_b = _chunked(model, b, [0, 11], [4, 5])[0][-1]
    torch.testing.assert_close(batched[0], sep_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], sep_b, atol=1e-5, rtol=1e-5)


def test_safetensors_checkpoint_round_trip(tmp_path):
    config = ModelConfig.preset("tiny", tie_word_embeddings=True)
    weights = random_weights(config, seed=5)
    _hf_model(config, weights).save_pretrained(tmp_path)
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == config
    assert loaded.lm_head is loaded.embed
    model = LlamaModel(loaded_config, loaded)
    tokens = list(range(3, 40))
    expected = _hf_logits(_hf_model(config, weights), tokens)
    got, _ = _chunked(model, tokens, [0, 20, 37], [0, 1, 2, 3, 4])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_random_weights_are_seeded():
    config = ModelConfig.preset("tiny")
    a, b, c = (random_weights(config, s) for s in (1, 1, 2))
    assert torch.equal(a.layers[1].q_proj, b.layers[1].q_proj)
    assert not torch.equal(a.layers[1].q_proj, c.layers[1].q_proj)
