"""Round-to-nearest quantization of a loaded 16/32-bit model (`--quantize fp8|int4`, `strata-engine quantize`).

    fmt = quantize_model(model, "int4")   # replaces every decoder projection in place; returns the format text

* fp8: e4m3 with one scale per output channel (amax / 448): compressed-tensors' FP8 channel scheme, the one
  torch._scaled_mm multiplies row-wise on Hopper.
* fp8-block: e4m3 with one scale per 128 x 128 block: the layout of Qwen's `*-FP8` checkpoints (and of
  transformers' FP8 path, which `strata-engine quantize --format fp8-block` writes for).
* int4: asymmetric, one scale and integer zero point per group of 128 inputs (64 or 32 where K is not a
  multiple of 128, one group of K where neither divides), codes 0..15: compressed-tensors' W4A16 asymmetric
  group scheme (value = (q - zero) * scale, zero = round(-min / scale)).

The projections of attention and of the MLP (dense, experts, the MTP block's) are quantized; embeddings, the LM
head, the MoE router and the MTP head's eh_proj stay in the model's dtype, as the published quantized
checkpoints keep them. `--quantize-head` (`quantize_head`) makes the LM head FP8 too, per vocabulary row.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ConfigError
from engine.model.quant.linear import FP8_MAX, Fp8Linear, IntGroupLinear

FORMATS = ("fp8", "fp8-block", "int4")
INT4_GROUP = 128
FP8_BLOCK = 128  # fp8-block: Qwen's *-FP8 blocks (128 x 128), one scale each


def quantizable(name: str) -> bool:
    """Whether a Linear of this (our parameter-side) name is quantized: attention and MLP projections."""
    leaf = name.rpartition(".")[2]
    return (".self_attn." in name or ".mlp." in name) and leaf.endswith("_proj")


def int4_group_size(k: int) -> int:
    return next((g for g in (INT4_GROUP, 64, 32) if k % g == 0), k)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scale [N, 1]): per output channel, amax maps to 448."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scale [ceil(N/b), ceil(K/b)]): one scale per block (its amax maps to 448),
    the edge blocks of a size that is no multiple of b padded with zeros, as Qwen's FP8 checkpoints are made."""
    n, k = weight.shape
    rows, cols = -(-n // block) * block, -(-k // block) * block
    padded = torch.zeros(rows, cols, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.to(torch.float32)
    blocks = padded.view(rows // block, block, cols // block, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows, cols)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes 0..15 int32 [N, K], scale [N, K/G], zero 0..15 [N, K/G]): asymmetric min-max per group,
    zero point an integer (so the range always holds 0 exactly)."""
    n, k = weight.shape
    w = weight.to(torch.float32).view(n, k // group, group)
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15)
    return codes.view(n, k).to(torch.int32), scale, zero


def quantize_linear(linear: nn.Linear, fmt: str, scale_dtype: torch.dtype):
    """One nn.Linear as the quantized layer of `fmt` (same device, bias kept)."""
    bias = linear.bias.detach() if linear.bias is not None else None
    if fmt == "fp8":
        q, scale = quantize_fp8(linear.weight.detach())
        return Fp8Linear(q, scale, (1, linear.in_features), bias)
    if fmt == "fp8-block":
        q, scale = quantize_fp8_block(linear.weight.detach())
        return Fp8Linear(q, scale, (FP8_BLOCK, FP8_BLOCK), bias)
    group = int4_group_size(linear.in_features)
    codes, scale, zero = quantize_int4(linear.weight.detach(), group)
    return IntGroupLinear(codes, scale, -zero * scale, 4, group, bias, scale_dtype=scale_dtype)


def quantize_model(model: nn.Module, fmt: str) -> str:
    """Quantize every `quantizable` Linear of `model` in place (before fuse_projections); the format's text."""
    if fmt not in FORMATS:
        raise ConfigError("quantize", fmt, f"expected one of {', '.join(FORMATS)}")
    if getattr(model, "fused", False):
        raise ValueError("quantize before fuse_projections: the fused layers have no checkpoint names")
    kept = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and quantizable(name):
            if fmt == "int4" and module.in_features % 8:
                kept += 1  # 4-bit codes fill whole 32-bit words: such a layer stays as loaded
                continue
            dtype = module.weight.dtype
            layer = quantize_linear(module, fmt, torch.float32 if dtype == torch.float32 else torch.float16)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)
    kept_text = f"; {kept} layer{'s' if kept != 1 else ''} of inputs not a multiple of 8 as loaded" if kept else ""
    return {"fp8": "fp8 (per channel, quantized at load)",
            "fp8-block": f"fp8 (block {FP8_BLOCK}x{FP8_BLOCK}, quantized at load)"}.get(
        fmt, f"int4 (group {INT4_GROUP}, quantized at load{kept_text})")


def quantize_head(model: nn.Module) -> str:
    """`--quantize-head`: the LM head as per-channel FP8 (a scale per vocabulary row), in place. A tied head gets
    its own FP8 copy (the embedding table stays as loaded); an untied one is replaced."""
    if isinstance(model.lm_head, Fp8Linear):
        return "fp8 head"
    q, scale = quantize_fp8(model.head_weight.detach())
    model.lm_head = Fp8Linear(q, scale, (1, q.shape[1]))
    return "fp8 head"
