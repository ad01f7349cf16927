"""A DeepSeek-V2-style decoder with multi-head latent attention (MLA) over a ``kv_factor = 1`` pool.

Why: MLA models (DeepSeek-V2/V3, Kimi) cache one *latent* row per token and layer instead of K and
V, so TensorRT-LLM gives the connector a pool of shape ``[num_blocks, num_layers, 1, B * 576]``
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, one "head"). Proving kvdepot on that geometry
needs a model whose attention really reads the latent back from the pool.

Attention follows the DeepSeek-V2 paper (§2.1), per token t and head i:

    c_t   = W_DKV h_t                     compressed latent (kv_lora_rank), RMS-normalized as the
                                          released models do
    k_R_t = RoPE(W_KR h_t)                decoupled RoPE key, shared by all heads (qk_rope_head_dim)
    cache = [c_t ; k_R_t]                 the only per-token state: one pool row of 576
    k_C_ti = W_UK_i c_t,  v_ti = W_UV_i c_t                        up-projections of the latent
    q_ti  = [W_UQ_i h_t ; RoPE(W_QR_i h_t)]                        (V2-Lite has no query latent)
    o_ti  = sum_j softmax_j(q_ti . [k_C_ji ; k_R_j] / sqrt(d_nope + d_rope)) v_ji
    u_t   = W_O [o_t1 ; ... ; o_tH]

``W_DKV``/``W_KR`` are one ``kv_a_proj`` and ``W_UK``/``W_UV`` one ``kv_b_proj``, as in the released
checkpoints, and RoPE rotates adjacent pairs as DeepSeek's code does (so logits match HuggingFace's
``DeepseekV2ForCausalLM``, see the tests). The feed-forward is a dense SwiGLU: V2-Lite's MoE layers
change no KV, so they are left out (its dense first layer's width is used everywhere). No YaRN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kvdepot.errors import ConfigError
from kvdepot.runtime.model import (
    _SDPA_BACKENDS,
    LayerHook,
    Reduce,
    Segment,
    _identity,
    _rms_norm,
    _SegmentPlan,
    check_kv_dtype,
    kv_load,
    lm_logits,
    plan_segments,
    read_rows,
    write_rows,
)
from kvdepot.runtime.weights import INIT_STD


@dataclass(frozen=True)
class MlaConfig:
    """Shape and numerics of an MLA decoder (DeepSeek-V2 names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None
    kv_scale: float = 1.0

    def __post_init__(self) -> None:
        check_kv_dtype(self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MlaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MlaConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE pairs)")

    kv_factor = 1  # one latent row, no separate V
    num_kv_heads = 1

    @property
    def head_dim(self) -> int:
        """Elements of one token's latent row: what the pool's inner ``head_dim`` is for MLA."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_block_elems_per_token(self) -> int:
        return self.head_dim

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_factor * self.head_dim * self.pool_dtype.itemsize


MLA_PRESETS: dict[str, MlaConfig] = {
    # CPU tests: DeepSeek's latent geometry (512 + 64) on a narrow, 2-layer body.
    "mla-tiny": MlaConfig(512, 128, 256, 2, 4, qk_nope_head_dim=32, v_head_dim=32),
    # DeepSeek-V2-Lite's attention shape: 27 layers, 16 heads, latent 512 + rope 64, bf16.
    "mla-v2-lite": MlaConfig(102400, 2048, 10944, 27, 16, dtype=torch.bfloat16),
}
MLA_PRESETS["mla-v2-lite-fp8"] = replace(MLA_PRESETS["mla-v2-lite"], kv_dtype=torch.float8_e4m3fn, kv_scale=1 / 16)


@dataclass
class MlaLayerWeights:
    """One layer; linear weights ``[out, in]``."""

    q_proj: torch.Tensor  # [H * (nope + rope), hidden]: W_UQ and W_QR
    kv_a_proj: torch.Tensor  # [rank + rope, hidden]: W_DKV and W_KR
    kv_a_norm: torch.Tensor  # [rank]
    kv_b_proj: torch.Tensor  # [H * (nope + v), rank]: W_UK and W_UV
    o_proj: torch.Tensor  # [hidden, H * v]
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


@dataclass
class MlaWeights:
    embed: torch.Tensor
    layers: list[MlaLayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def mla_random_weights(c: MlaConfig, seed: int, device: str | torch.device = "cpu") -> MlaWeights:
    """Seeded normal(0, 0.02) matrices and unit norms, drawn on ``device`` (like ``random_weights``)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=c.dtype, device=device)
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return t.mul_(INIT_STD).to(c.dtype)

    h, heads, qk = c.hidden_size, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    layers = [MlaLayerWeights(
        q_proj=draw(heads * qk, h), kv_a_proj=draw(c.kv_lora_rank + c.qk_rope_head_dim, h),
        kv_a_norm=draw(c.kv_lora_rank), kv_b_proj=draw(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        o_proj=draw(h, heads * c.v_head_dim), gate_proj=draw(c.intermediate_size, h),
        up_proj=draw(c.intermediate_size, h), down_proj=draw(h, c.intermediate_size),
        input_norm=draw(h), post_norm=draw(h),
    ) for _ in range(c.num_layers)]
    return MlaWeights(draw(c.vocab_size, h), layers, draw(h), draw(c.vocab_size, h))


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs ``(x[2j], x[2j+1])``, DeepSeek's layout, computed in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


class MlaModel:
    """Forward passes over request segments with the latent KV kept in a ``kv_factor = 1`` pool."""

    def __init__(self, config: MlaConfig, weights: MlaWeights):
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        d = config.qk_rope_head_dim
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self._inv_freq = inv.to(self.device)
        self.reduce: Reduce = _identity  # tensor parallel: the sum over ranks (``tp.shard_model``)

    def pool_shape(self, num_blocks: int, tokens_per_block: int) -> tuple[int, int, int, int]:
        """``[NB, L, 1, 1 * B * (kv_lora_rank + qk_rope_head_dim)]``."""
        c = self.config
        return (num_blocks, c.num_layers, 1, tokens_per_block * c.head_dim)

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], pool: torch.Tensor, pre_layer: LayerHook | None = None,
                post_layer: LayerHook | None = None, all_logits: bool = False) -> list[torch.Tensor]:
        """As ``LlamaModel.forward``: writes each segment's latent rows, reads ``[0, end)`` back."""
        c, w = self.config, self.weights
        bpt = pool.shape[3] // c.head_dim
        pool6 = pool.view(pool.shape[0], pool.shape[1], 1, 1, bpt, c.head_dim)
        plans, ids, pos = plan_segments(segments, bpt, self.device)
        angles = pos.float()[:, None, None] * self._inv_freq[None, None, :]  # [n, 1, rope / 2]
        cos, sin = angles.cos(), angles.sin()
        x = F.embedding(ids, w.embed)
        with sdpa_kernel(_SDPA_BACKENDS):
            for i, lw in enumerate(w.layers):
                if pre_layer is not None:
                    pre_layer(i)
                attn = self._attention(_rms_norm(x, lw.input_norm, c.rms_norm_eps), lw, plans, pool6[:, i], cos, sin)
                x = x + self.reduce(attn)
                h = _rms_norm(x, lw.post_norm, c.rms_norm_eps)
                x = x + self.reduce(F.linear(F.silu(F.linear(h, lw.gate_proj)) * F.linear(h, lw.up_proj), lw.down_proj))
                if post_layer is not None:
                    post_layer(i)
        return lm_logits(x, plans, w.norm, w.lm_head, c.rms_norm_eps, all_logits)

    def _attention(self, h: torch.Tensor, lw: MlaLayerWeights, plans: list[_SegmentPlan],
                   layer_kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        nope, rope, heads = c.qk_nope_head_dim, c.qk_rope_head_dim, c.num_heads
        q = F.linear(h, lw.q_proj).view(-1, heads, nope + rope)
        q_nope, q_rope = q.split((nope, rope), dim=-1)
        q_rope = _rope_pairs(q_rope, cos, sin)
        latent, k_rope = F.linear(h, lw.kv_a_proj).split((c.kv_lora_rank, rope), dim=-1)
        latent = _rms_norm(latent, lw.kv_a_norm, c.rms_norm_eps)
        k_rope = _rope_pairs(k_rope[:, None, :], cos, sin)
        row = torch.cat((latent[:, None, :], k_rope), dim=-1)  # [n, 1, rank + rope]: the cached row
        q = torch.cat((q_nope, q_rope), dim=-1)
        return torch.cat([self._attend(q, row, plan, layer_kv, lw) for plan in plans]) @ lw.o_proj.T

    def _attend(self, q: torch.Tensor, row: torch.Tensor, plan: _SegmentPlan, layer_kv: torch.Tensor,
                lw: MlaLayerWeights) -> torch.Tensor:
        """Write the segment's latent rows, read ``[0, end)`` back, up-project, attend."""
        c = self.config
        nope, heads = c.qk_nope_head_dim, c.num_heads
        write_rows(layer_kv, plan, (row,), c.kv_scale)
        cached = kv_load(read_rows(layer_kv, plan), c.dtype, c.kv_scale)[0, 0]  # [end, rank + rope]
        latent, k_rope = cached.split((c.kv_lora_rank, c.qk_rope_head_dim), dim=-1)
        k_nope, v = F.linear(latent, lw.kv_b_proj).view(-1, heads, nope + c.v_head_dim).split(
            (nope, c.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, heads, -1)), dim=-1)
        out = F.scaled_dot_product_attention(
            q[plan.rows].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=plan.mask, is_causal=plan.is_causal,
            scale=1.0 / math.sqrt(nope + c.qk_rope_head_dim),
        )
        return out[0].transpose(0, 1).reshape(-1, heads * c.v_head_dim)
