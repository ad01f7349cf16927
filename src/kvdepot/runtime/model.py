"""A Llama-architecture decoder in plain torch whose attention lives in TensorRT-LLM's paged pool.

Why our own model: TensorRT-LLM cannot be installed here, and a connector is only proven when the
KV it loads into the pool is *read* by later forwards. So attention never keeps a private cache: a
forward over tokens ``[start, end)`` of a request writes their K/V into the pool and attends over
``[0, end)`` read back from the pool, exactly where TensorRT-LLM keeps them:

    pool.shape == [num_blocks, num_layers, 2, num_kv_heads * tokens_per_block * head_dim]

each ``[block, layer, k|v]`` row laid out ``[num_kv_heads, tokens_per_block, head_dim]`` (HND), and
token ``t`` of a request in block ``block_ids[t // B]`` at offset ``t % B``.

Numerics follow HuggingFace's ``LlamaForCausalLM`` (RMSNorm in float32, rotate-half RoPE with
optional llama3 frequency scaling, GQA by repeating KV heads, SwiGLU), so logits match it.

An FP8 pool (``kv_dtype=torch.float8_e4m3fn``) stores ``K / kv_scale`` and ``V / kv_scale``
saturated to e4m3, and attention reads them back as ``fp8 * kv_scale`` in the model dtype, as
TensorRT-LLM's FP8 KV cache does with its per-tensor scale. ``mla.py`` is the MLA model; both
satisfy ``PagedModel``, the engine's view of a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvdepot.errors import ConfigError

if TYPE_CHECKING:
    from kvdepot.runtime.weights import LlamaWeights

LayerHook = Callable[[int], None]
Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x

# NOTE: cuDNN attention is left out: it builds a plan per new sequence length, which costs about a
# millisecond of CPU per call when every decode step has a new key length.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (HF ``rope_type: llama3``): long wavelengths slowed by ``factor``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-architecture decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    kv_dtype: torch.dtype | None = None  # the pool's dtype when it is not the model's (FP8 KV)
    kv_scale: float = 1.0  # FP8 KV: stored value = K or V / kv_scale

    def __post_init__(self) -> None:
        check_kv_dtype(self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ModelConfig:
        """A named shape (``tiny``, ``small``, ``llama-1b``, ``llama-8b``), optionally altered."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]

    @property
    def kv_block_elems_per_token(self) -> int:
        """Elements one token occupies in one K or V row of the pool."""
        return self.num_kv_heads * self.head_dim

    kv_factor = 2  # K and V rows

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Pool bytes one token takes across all layers."""
        return self.num_layers * self.kv_factor * self.kv_block_elems_per_token * self.pool_dtype.itemsize


FP8_DTYPES = (torch.float8_e4m3fn,)


def check_kv_dtype(config: object) -> None:
    kv, scale = config.kv_dtype, config.kv_scale  # type: ignore[attr-defined]
    if kv is not None and kv not in FP8_DTYPES:
        raise ConfigError(f"kv_dtype={kv}: only None (the model's dtype) or {FP8_DTYPES} are supported")
    if not scale > 0:
        raise ConfigError(f"kv_scale={scale} must be positive")


def kv_store(rows: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K/V rows as the pool stores them: as is, or divided by ``scale`` and saturated to FP8."""
    if pool_dtype not in FP8_DTYPES:
        return rows
    limit = torch.finfo(pool_dtype).max
    return (rows.float() / scale).clamp_(-limit, limit).to(pool_dtype)


def kv_load(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Pool rows back in the model's dtype (FP8 dequantized with ``scale``)."""
    if stored.dtype not in FP8_DTYPES:
        return stored
    return (stored.float() * scale).to(dtype)


class PagedModel(Protocol):
    """What the engine needs of a model: its pool's shape and dtype, and a paged forward."""

    config: ModelConfig  # or mla.MlaConfig: vocab_size, num_layers, dtype, pool_dtype, kv_bytes_per_token
    device: torch.device

    def pool_shape(self, num_blocks: int, tokens_per_block: int) -> tuple[int, int, int, int]: ...

    def forward(self, segments: Sequence[Segment], pool: torch.Tensor, pre_layer: LayerHook | None = None,
                post_layer: LayerHook | None = None, all_logits: bool = False) -> list[torch.Tensor]: ...


_LLAMA3_ROPE_1B = RopeScaling(32.0, 1.0, 4.0, 8192)
_LLAMA3_ROPE_8B = RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    # CPU unit tests: small enough that a forward is milliseconds.
    "tiny": ModelConfig(512, 64, 128, 2, 4, 2, 16),
    # CPU demo: a few layers, still fast, large enough to look like a model.
    "small": ModelConfig(4096, 256, 768, 4, 8, 2, 32),
    # Llama-3.2-1B shape.
    "llama-1b": ModelConfig(128256, 2048, 8192, 16, 32, 8, 64, rope_theta=500000.0,
                            dtype=torch.bfloat16, tie_word_embeddings=True,
                            rope_scaling=_LLAMA3_ROPE_1B),
    # Llama-3.1-8B shape.
    "llama-8b": ModelConfig(128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0,
                            dtype=torch.bfloat16, rope_scaling=_LLAMA3_ROPE_8B),
}
# The same shapes over an FP8 (e4m3) KV pool; the scale keeps random-weight K/V in e4m3's range.
PRESETS.update({f"{name}-fp8": replace(PRESETS[name], kv_dtype=torch.float8_e4m3fn, kv_scale=1 / 16)
                for name in ("tiny", "llama-1b", "llama-8b")})


@dataclass
class Segment:
    """One request's slice of a forward: tokens ``[start, start + len(token_ids))``."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, CPU), with llama3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling  # type: ignore[union-attr]
    if s is None:
        return inv
    # NOTE: llama3 scaling keeps short wavelengths, divides long ones by `factor`, and blends
    # linearly in between; the same piecewise rule HF applies for rope_type "llama3".
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 and cast back, as HF does, so bf16 results agree with it too.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _SegmentPlan:
    """Index tensors for one segment, built once per forward and reused by every layer."""

    def __init__(self, seg: Segment, offset: int, tokens_per_block: int, device: torch.device):
        n = len(seg.token_ids)
        self.rows = slice(offset, offset + n)
        self.end = seg.start + n
        num_blocks = -(-self.end // tokens_per_block)
        if len(seg.block_ids) < num_blocks:
            raise ValueError(
                f"segment ends at token {self.end} but has only {len(seg.block_ids)} blocks "
                f"of {tokens_per_block} tokens"
            )
        table = torch.tensor(list(seg.block_ids[:num_blocks]), dtype=torch.long, device=device)
        pos = torch.arange(seg.start, self.end, device=device)
        self.write_blocks = table[pos // tokens_per_block]
        self.write_offsets = pos % tokens_per_block
        self.read_blocks = table
        self.mask: torch.Tensor | None = None
        self.is_causal = seg.start == 0 and n > 1
        if seg.start > 0 and n > 1:
            keys = torch.arange(self.end, device=device)
            self.mask = keys[None, :] <= pos[:, None]


def plan_segments(segments: Sequence[Segment], tokens_per_block: int,
                  device: torch.device) -> tuple[list[_SegmentPlan], torch.Tensor, torch.Tensor]:
    """Per-segment index plans, and the batch's token ids and positions, for one forward."""
    plans, tokens, positions, offset = [], [], [], 0
    for seg in segments:
        plans.append(_SegmentPlan(seg, offset, tokens_per_block, device))
        tokens.extend(seg.token_ids)
        positions.append(torch.arange(seg.start, seg.start + len(seg.token_ids)))
        offset += len(seg.token_ids)
    return plans, torch.tensor(tokens, dtype=torch.long, device=device), torch.cat(positions).to(device)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE tables ``[n, 1, dim]`` for the given positions."""
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def lm_logits(x: torch.Tensor, plans: list[_SegmentPlan], norm: torch.Tensor, lm_head: torch.Tensor,
              eps: float, all_logits: bool) -> list[torch.Tensor]:
    """Final norm and LM head: per segment, its last token's logits (or every token's)."""
    if not all_logits:
        x = x[torch.tensor([p.rows.stop - 1 for p in plans], device=x.device)]
    logits = F.linear(_rms_norm(x, norm, eps), lm_head).float()
    if all_logits:
        return [logits[p.rows] for p in plans]
    return list(logits.unbind(0))


def write_rows(layer_kv: torch.Tensor, plan: _SegmentPlan, rows: Sequence[torch.Tensor], scale: float) -> None:
    """Write the segment's rows (one ``[n, Hkv, D]`` tensor per K/V factor) at their positions."""
    for f, x in enumerate(rows):
        # layer_kv: [NB, factor, Hkv, B, D]; a transposed view makes (block, offset) adjacent indices.
        layer_kv[:, f].transpose(1, 2)[plan.write_blocks, plan.write_offsets] = kv_store(
            x[plan.rows], layer_kv.dtype, scale)


def read_rows(layer_kv: torch.Tensor, plan: _SegmentPlan) -> torch.Tensor:
    """Positions ``[0, end)`` of the request from the pool, as stored: ``[factor, Hkv, end, D]``."""
    blocks = layer_kv[plan.read_blocks]  # [nb, factor, Hkv, B, D]
    nb, factor, hkv, bpt, d = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4).reshape(factor, hkv, nb * bpt, d)[:, :, : plan.end]


class LlamaModel:
    """Forward passes over a batch of request segments, with K/V kept in a TensorRT-LLM pool."""

    def __init__(self, config: ModelConfig, weights: LlamaWeights):
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        self._inv_freq = rope_inv_freq(config).to(self.device)
        self.reduce: Reduce = _identity  # tensor parallel: the sum over ranks (``tp.shard_model``)

    def pool_shape(self, num_blocks: int, tokens_per_block: int) -> tuple[int, int, int, int]:
        """The pool TensorRT-LLM would allocate for this model: ``[NB, L, 2, Hkv*B*D]``."""
        c = self.config
        return (num_blocks, c.num_layers, 2, c.num_kv_heads * tokens_per_block * c.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        segments: Sequence[Segment],
        pool: torch.Tensor,
        pre_layer: LayerHook | None = None,
        post_layer: LayerHook | None = None,
        all_logits: bool = False,
    ) -> list[torch.Tensor]:
        """Run one forward pass over every segment, writing and reading K/V in ``pool``.

        Args:
            segments: per request, the tokens to compute now, their first position and the
                request's block ids (at least enough to hold position ``start + len - 1``).
            pool: the KV pool, shape ``pool_shape(...)``, dtype of the model.
            pre_layer: called with layer index ``i`` right before layer ``i``'s work.
            post_layer: called with layer index ``i`` right after layer ``i``'s work.
            all_logits: return logits for every token rather than only the last of each segment.

        Returns:
            Per segment, float32 logits ``[vocab]`` (last token) or ``[n, vocab]``.
        """
        c, w = self.config, self.weights
        hkv, d = c.num_kv_heads, c.head_dim
        bpt = pool.shape[3] // (hkv * d)
        pool6 = pool.view(pool.shape[0], pool.shape[1], 2, hkv, bpt, d)
        plans, ids, pos = plan_segments(segments, bpt, self.device)
        cos, sin = rope_cos_sin(pos, self._inv_freq, c.dtype)
        x = F.embedding(ids, w.embed)
        with sdpa_kernel(_SDPA_BACKENDS):
            x = self._layers(x, plans, pool6, cos, sin, pre_layer, post_layer)
        return lm_logits(x, plans, w.norm, w.lm_head, c.rms_norm_eps, all_logits)

    def _layers(self, x: torch.Tensor, plans: list[_SegmentPlan], pool6: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, pre_layer: LayerHook | None,
                post_layer: LayerHook | None) -> torch.Tensor:
        """The decoder stack; the hooks bracket each layer's work, as TensorRT-LLM's module hooks do."""
        c, d, hkv = self.config, self.config.head_dim, self.config.num_kv_heads
        for i, lw in enumerate(self.weights.layers):
            if pre_layer is not None:
                pre_layer(i)
            h = _rms_norm(x, lw.input_norm, c.rms_norm_eps)
            q = F.linear(h, lw.q_proj).view(-1, c.num_heads, d)
            k = F.linear(h, lw.k_proj).view(-1, hkv, d)
            v = F.linear(h, lw.v_proj).view(-1, hkv, d)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            attn = torch.cat([self._attend(q, k, v, p, pool6[:, i]) for p in plans])
            x = x + self.reduce(F.linear(attn, lw.o_proj))
            h = _rms_norm(x, lw.post_norm, c.rms_norm_eps)
            x = x + self.reduce(F.linear(F.silu(F.linear(h, lw.gate_proj)) * F.linear(h, lw.up_proj), lw.down_proj))
            if post_layer is not None:
                post_layer(i)
        return x

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _SegmentPlan,
                layer_kv: torch.Tensor) -> torch.Tensor:
        """Write this segment's K/V into the pool, then attend over ``[0, end)`` read from it."""
        c = self.config
        write_rows(layer_kv, plan, (k, v), c.kv_scale)
        kv = kv_load(read_rows(layer_kv, plan), c.dtype, c.kv_scale)  # [2, Hkv, end, D]
        hkv, d = kv.shape[1], kv.shape[3]
        rep = c.num_heads // hkv
        keys = kv[0].repeat_interleave(rep, dim=0)
        values = kv[1].repeat_interleave(rep, dim=0)
        # 4-D [1, H, n, D] inputs let SDPA pick its flash/memory-efficient kernels on CUDA.
        out = F.scaled_dot_product_attention(
            q[plan.rows].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=plan.mask, is_causal=plan.is_causal,
        )
        return out[0].transpose(0, 1).reshape(-1, c.num_heads * d)
