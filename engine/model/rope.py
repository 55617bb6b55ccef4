"""Rotary position embeddings: inverse frequencies for each supported rope_scaling type, and their application.

The formulas follow transformers' `modeling_rope_utils` so checkpoints trained there behave the same here.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.config import ModelConfig, RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def inv_freq_for(config: ModelConfig, seq_len_tokens: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] fp32, cos/sin scale) for this config's rope type.

    `seq_len_tokens` matters only for "dynamic" (NTK) scaling, whose base grows past max_position_embeddings.
    """
    rope, dim = config.rope, config.head_dim
    if rope.type == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if rope.type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if rope.type == "dynamic":
        max_pos = config.max_position_embeddings
        seq = max(seq_len_tokens or max_pos, max_pos)
        base = rope.theta * ((rope.factor * seq / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope.type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, dim)
    raise ValueError(f"rope type {rope.type!r} is not supported")  # config.py refuses these first


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions. The inverse frequencies are a non-persistent buffer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Always computed on the CPU: a model built on the meta device would otherwise pull in torch._dynamo
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = inv_freq_for(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dynamic = config.rope.type == "dynamic"
        self.ops = None  # FUSED_OPS (engine.model.triton_ops): the tables in one kernel where this computes ten

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute the buffer (after the module was built on the meta device)."""
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = inv_freq_for(self.config)
        self.inv_freq = inv_freq.to(device if device is not None else self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] long -> (cos, sin_rot) [B, T, head_dim] in `dtype`, for apply_rope.

        sin_rot is the sin table with rotate_half's sign folded in (first half negated): built once per forward,
        it saves every attention layer the negate-and-concatenate of rotate_half (kernels, on a decode step).
        """
        inv_freq = self.inv_freq
        if self.ops is not None and not self.dynamic:
            return self.ops.rope_tables(positions, inv_freq, self.attention_scaling, dtype)
        if self.dynamic:
            # Data-dependent on purpose (as in transformers): a host sync, so no CUDA graph for dynamic NTK.
            seq_len = int(positions.max().item()) + 1
            if seq_len > self.config.max_position_embeddings:
                with torch.device("cpu"):
                    inv_freq = inv_freq_for(self.config, seq_len)[0]
                inv_freq = inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        half = sin.shape[-1] // 2
        sin_rot = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.to(dtype), sin_rot.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin_rot [B, T, D] (RotaryEmbedding) -> x rotated, the half-split layout of HF
    checkpoints: x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x, D/2) with the
    first half negated, and that sign already sits in sin_rot. Bit-for-bit the same values, fewer kernels."""
    return x * cos.unsqueeze(1) + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_rot.unsqueeze(1)
