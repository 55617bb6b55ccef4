"""The building blocks of one decoder layer: RMSNorm, attention (GQA, optional q/k norm and qkv bias), SwiGLU.

Attention owns no KV storage: it hands q, k, v (after q/k norm and RoPE) to the `kv` object it is given
(`kv.attend(layer_idx, q, k, v, positions)`), or, with `kv=None`, attends causally over the T given tokens
(the training / full-forward path, plain differentiable ops).

With FUSED_OPS (`CausalLM.use_fused_ops`, CUDA) the elementwise chains run as the Triton kernels of
engine.model.triton_ops (residual add + RMSNorm, q/k norm + RoPE, SiLU * up), and a decode step's narrow
projections (o, down) as its skinny matmul (engine.model.triton_linear); the reference ops stay for CPU,
training and the tests' oracle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.moe import SparseMoE, moe_index_of
from engine.model.quant.linear import concat_linears, is_quantized
from engine.model.rope import apply_rope

# engine.model.triton_ops once `use_fused_ops` set it (the module imports Triton, which CPU installs may lack)
FusedOps = Any


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32 and cast back before the weight, as HF checkpoints expect."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, computed in fp32 and rounded once to x's dtype (as HF does
    before its weight multiply). F.rms_norm does exactly that, in one fused kernel on CUDA where the written-out
    formula launches seven: a decode step is bound by its kernel count."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over the T given tokens: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _fuse_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One Linear whose output is the concatenation of `linears`' outputs (weights concatenated on dim 0); for
    quantized layers one of their layout, or None when their blocks do not line up (they then stay apart)."""
    first = linears[0]
    if any(is_quantized(lin) for lin in linears):
        return concat_linears(linears)
    has_bias = first.bias is not None
    out_features = sum(lin.out_features for lin in linears)
    fused = nn.Linear(first.in_features, out_features, bias=has_bias, device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears], dim=0))
        if has_bias:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears], dim=0))
    return fused.requires_grad_(first.weight.requires_grad)


def _project(ops: FusedOps | None, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """FUSED_OPS: a decode step's narrow product through the skinny-matmul kernel; a quantized layer has its own."""
    if ops is not None and not is_quantized(linear):
        return ops.linear(x, linear.weight, linear.bias)
    return linear(x)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads; Qwen3's per-head q/k RMSNorm; Qwen2's qkv bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        # Qwen2 has bias on q/k/v only; Qwen3's and Llama's attention_bias covers o_proj too
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=bias and config.arch != "qwen2")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_proj: nn.Module | None = None
        self.ops: FusedOps | None = None

    def fuse(self) -> None:
        """Replace q/k/v projections by one concatenated Linear (same outputs, one matmul)."""
        if self.qkv_proj is not None:
            return
        fused = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, positions, kv, layer_idx: int) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; writes/reads KV through `kv` (or none when kv is None)."""
        B, T, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:  # q and k are adjacent in the fused output: one view holds both
            qkv = self.qkv_proj(x).view(B, T, hq + 2 * hkv, d)
            # FUSED_OPS with the serving cache's write kernel: the norm + RoPE kernel stores k and v in the pool
            # (one kernel where it took two); a cache that hands out no write site gets them through attend
            write_site = getattr(kv, "write_site", None) if self.ops is not None else None
            site = write_site(layer_idx, positions) if write_site is not None else None
            if site is not None:
                q = self.ops.qk_norm_rope_kv(qkv, hq, *self._qk_norm_args(cos, sin), site)
                return self._project_heads(kv.attend_written(layer_idx, q, positions))
            qk, v = qkv[:, :, :hq + hkv], qkv[:, :, hq + hkv:]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            qk = torch.cat([q.view(B, T, hq, d), k.view(B, T, hkv, d)], dim=2)
            v = v.view(B, T, hkv, d)
        # q and k heads side by side [B, T, Hq+Hkv, D]: one norm and one rotation for both (the same per-head
        # arithmetic as two separate passes, in half the kernels).
        if self.ops is not None:  # FUSED_OPS: norm and rotation in one kernel, written as [B, Hq+Hkv, T, D]
            qk = self.ops.qk_norm_rope(qk, hq, *self._qk_norm_args(cos, sin))
        else:
            if self.q_norm is not None:
                weight = torch.cat([self.q_norm.weight.expand(hq, d), self.k_norm.weight.expand(hkv, d)])
                qk = weight * rms_normalize(qk, self.q_norm.eps)
            qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [B, Hq+Hkv, T, D]
        q, k = qk[:, :hq], qk[:, hq:]
        v = v.transpose(1, 2)  # [B, Hkv, T, D]
        if kv is None:
            return self._project_heads(causal_attention(q, k, v))
        return self._project_heads(kv.attend(layer_idx, q, k, v, positions))

    def _qk_norm_args(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """(q's norm weight, k's, cos, sin, eps) for the FUSED_OPS norm + RoPE kernels; no q/k norm: None, None."""
        if self.q_norm is None:
            return None, None, cos, sin, 0.0
        return self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps

    def _project_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[B, Hq, T, D] -> [B, T, H]: the heads side by side through the o projection."""
        b, _, t, _ = out.shape
        return _project(self.ops, self.o_proj, out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None
        self.ops: FusedOps | None = None

    def fuse(self) -> None:
        """Replace gate/up by one concatenated Linear."""
        if self.gate_up_proj is not None:
            return
        fused = _fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.ops is not None:
            return _project(self.ops, self.down_proj, self.ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe_index = moe_index_of(config, layer_idx)  # Qwen3-MoE: a routed MLP where the config says so
        self.mlp = MLP(config) if moe_index is None else SparseMoE(config, moe_index)
        self.ops: FusedOps | None = None

    def fuse(self) -> None:
        """Fuse this layer's q/k/v and gate/up projections."""
        self.self_attn.fuse()
        self.mlp.fuse()

    def use_ops(self, ops: FusedOps | None) -> None:
        """Run this layer's elementwise chains through `ops` (engine.model.triton_ops), or None: the reference."""
        self.ops = self.self_attn.ops = ops
        if isinstance(self.mlp, MLP):  # a routed MoE block keeps its own expert path
            self.mlp.ops = ops

    def forward(self, x, cos, sin, positions, kv, layer_idx: int) -> torch.Tensor:
        if self.ops is not None:
            out, residual = self.forward_carry(x, None, cos, sin, positions, kv, layer_idx)
            return out + residual
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv, layer_idx)
        return x + self._mlp(self.post_attention_layernorm(x), positions)

    def forward_carry(self, x, residual, cos, sin, positions, kv, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FUSED_OPS: (mlp output, residual stream) with the stream's last add left to the next layer's norm
        kernel (`residual` None: x is the stream). The sums are the reference's, in the same order."""
        normed, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        attended = self.self_attn(normed, cos, sin, positions, kv, layer_idx)
        norm = self.post_attention_layernorm
        normed, residual = self.ops.add_rms_norm(attended, residual, norm.weight, norm.eps)
        return self._mlp(normed, positions), residual

    def attention_half(self, x, residual, cos, sin, positions, kv, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its MLP: (the MLP's input, the residual stream after attention), with `residual` what
        forward_carry takes (FUSED_OPS) or None (the reference: x is the stream). The layer's output is then
        `stream + mlp(input)` on the reference path, and (mlp(input), stream) carried on the fused one: the same
        sums as `forward` / `forward_carry`, split so a layer-major prefill window (engine.exec.prefill_window)
        can run one MoE over several chunks' tokens."""
        if self.ops is not None:
            normed, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight,
                                                     self.input_layernorm.eps)
            attended = self.self_attn(normed, cos, sin, positions, kv, layer_idx)
            norm = self.post_attention_layernorm
            return self.ops.add_rms_norm(attended, residual, norm.weight, norm.eps)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv, layer_idx)
        return self.post_attention_layernorm(x), x

    def _mlp(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A routed block also sees the positions (a synthetic source's router prior drifts with them)."""
        return self.mlp(x, positions) if isinstance(self.mlp, SparseMoE) else self.mlp(x)
