"""Weights of the reference Llama model: seeded random init, or a local HuggingFace checkpoint.

Random weights are enough to exercise a KV connector (the check is "same logits with and without
the cache", not quality), and they need no download. A local ``LlamaForCausalLM`` directory
(``config.json`` + ``*.safetensors``) gives real outputs when one is at hand. Tensor names follow
HuggingFace, so the same map serves loading and the equivalence tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from kvdepot.errors import ConfigError
from kvdepot.runtime.model import PRESETS, LlamaModel, ModelConfig, PagedModel, RopeScaling

if TYPE_CHECKING:
    from kvdepot.runtime.mla import MlaConfig

INIT_STD = 0.02  # keeps activations O(1) through the residual stream for any preset


@dataclass
class LayerWeights:
    """One decoder layer; linear weights are ``[out, in]`` like ``nn.Linear``."""

    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


_LAYER_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj", "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
}


@dataclass
class LlamaWeights:
    """All weights; ``lm_head is embed`` when the embeddings are tied."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HuggingFace name, tensor)`` pairs, ``lm_head.weight`` included even when tied."""
        yield "model.embed_tokens.weight", self.embed
        for i, layer in enumerate(self.layers):
            for attr, hf in _LAYER_NAMES.items():
                yield f"model.layers.{i}.{hf}.weight", getattr(layer, attr)
        yield "model.norm.weight", self.norm
        yield "lm_head.weight", self.lm_head


def _shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {
        "q_proj": (c.num_heads * c.head_dim, c.hidden_size),
        "k_proj": (c.num_kv_heads * c.head_dim, c.hidden_size),
        "v_proj": (c.num_kv_heads * c.head_dim, c.hidden_size),
        "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
        "input_norm": (c.hidden_size,),
        "post_norm": (c.hidden_size,),
    }


def random_weights(config: ModelConfig, seed: int, device: str | torch.device = "cpu") -> LlamaWeights:
    """Seeded normal(0, 0.02) matrices and unit norms, drawn on ``device``.

    Deterministic for a (seed, device type): drawing on the target device keeps an 8B init fast
    on a GPU, at the price that CPU and CUDA draws differ.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=config.dtype, device=device)
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return t.mul_(INIT_STD).to(config.dtype)

    embed = draw((config.vocab_size, config.hidden_size))
    shapes = _shapes(config)
    layers = [LayerWeights(**{k: draw(s) for k, s in shapes.items()}) for _ in range(config.num_layers)]
    norm = draw((config.hidden_size,))
    lm_head = embed if config.tie_word_embeddings else draw((config.vocab_size, config.hidden_size))
    return LlamaWeights(embed, layers, norm, lm_head)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def config_from_hf(path: str | Path, dtype: torch.dtype | None = None) -> ModelConfig:
    """Read a ``LlamaForCausalLM`` ``config.json`` (transformers 4.x or 5.x spelling)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("model_type", "llama") != "llama":
        raise ConfigError(f"config.json model_type={raw.get('model_type')!r}; only 'llama' is supported")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]),
                              int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise ConfigError(f"rope_type={rope_type!r} is not supported; use 'default' or 'llama3'")
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype is None and name not in _DTYPES:
        raise ConfigError(f"config.json dtype {name!r}; expected one of {sorted(_DTYPES)}")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        dtype=dtype or _DTYPES[name],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
    )


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[ModelConfig, LlamaWeights]:
    """Load a local HuggingFace Llama directory: ``config.json`` plus ``*.safetensors`` shards."""
    path = Path(path)
    config = config_from_hf(path, dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                tensors[key] = f.get_tensor(key).to(config.dtype)

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"checkpoint {path} lacks tensor {name}")
        t = tensors.pop(name)
        if tuple(t.shape) != shape:
            raise ConfigError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        return t

    c, shapes = config, _shapes(config)
    embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    layers = [
        LayerWeights(**{a: take(f"model.layers.{i}.{hf}.weight", shapes[a]) for a, hf in _LAYER_NAMES.items()})
        for i in range(c.num_layers)
    ]
    norm = take("model.norm.weight", (c.hidden_size,))
    if "lm_head.weight" in tensors and not c.tie_word_embeddings:
        lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))
    elif c.tie_word_embeddings:
        lm_head = embed
    else:
        raise ConfigError(f"checkpoint {path} lacks lm_head.weight and does not tie embeddings")
    return config, LlamaWeights(embed, layers, norm, lm_head)


def preset_config(name: str) -> ModelConfig | MlaConfig:
    """The config of a named preset, Llama (``PRESETS``) or MLA (``MLA_PRESETS``)."""
    from kvdepot.runtime.mla import MLA_PRESETS

    if name in PRESETS:
        return PRESETS[name]
    if name in MLA_PRESETS:
        return MLA_PRESETS[name]
    raise ConfigError(f"unknown model preset {name!r}; known: {sorted(all_preset_names())}")


def all_preset_names() -> list[str]:
    from kvdepot.runtime.mla import MLA_PRESETS

    return sorted([*PRESETS, *MLA_PRESETS])


def build_model(model: ModelConfig | MlaConfig | str | Path, device: torch.device,
                seed: int) -> tuple[PagedModel, str]:
    """A model from a config (seeded random weights), a preset name, or a checkpoint directory.

    Returns the model and a name for ``llm_args.model``. Connectors may key caches on it, so a
    random model's name carries its seed and device type: different weights, different name.
    """
    from kvdepot.runtime.mla import MlaConfig, MlaModel, mla_random_weights

    if isinstance(model, (ModelConfig, MlaConfig)) or (isinstance(model, str) and model in all_preset_names()):
        config = model if isinstance(model, (ModelConfig, MlaConfig)) else preset_config(model)
        label = model if isinstance(model, str) else f"custom-{config.num_layers}x{config.hidden_size}"
        name = f"{label}-random-seed{seed}-{torch.device(device).type}"
        if isinstance(config, MlaConfig):
            return MlaModel(config, mla_random_weights(config, seed, device)), name
        return LlamaModel(config, random_weights(config, seed, device)), name
    if Path(model).is_dir():
        config, weights = load_checkpoint(model, device)
        return LlamaModel(config, weights), str(model)
    raise ConfigError(f"model {model!r} is neither a preset {all_preset_names()} nor a checkpoint directory")
