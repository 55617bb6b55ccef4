"""Quantized test checkpoints made from an unquantized one, each in a published layout.

* compressed-tensors (FP8 channel, int4 group sym/asym): written by the compressed-tensors library itself
  (its observers' qparams formula, its compressors, its QuantizationConfig), never by our writer.
* Qwen FP8 (block 128x128, weight_scale_inv), AWQ GEMM and GPTQ: their libraries are CUDA-only, so small
  writers here follow the published packing (DeepSeek/Qwen's block scheme; AutoAWQ's `pack` with the order
  map 0,2,4,6,1,3,5,7; AutoGPTQ's `pack` with qzeros stored minus one), and `reference_weight` dequantizes each
  with the spec's own formula (an independent loop over nibbles), which the tests compare with our loader.

Every writer returns {projection prefix: the dequantized fp32 weight the file encodes}.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _is_proj(name: str) -> bool:
    base = name[:-len(".weight")] if name.endswith(".weight") else ""
    leaf = base.rpartition(".")[2]
    return bool(base) and (".self_attn." in base or ".mlp." in base) and leaf.endswith("_proj")


def _copy_rest(src: Path, dst: Path, quantization_config: dict) -> dict[str, torch.Tensor]:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return {k: v.to(torch.float32) for k, v in load_file(str(src / "model.safetensors")).items()}


def write_qwen_fp8(src: Path, dst: Path, block: int = 128) -> dict[str, torch.Tensor]:
    tensors = _copy_rest(src, dst, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                    "weight_block_size": [block, block]})
    out, ref = {}, {}
    for name, w in tensors.items():
        if not _is_proj(name):
            out[name] = w
            continue
        n, k = w.shape
        pad = torch.zeros(math.ceil(n / block) * block, math.ceil(k / block) * block)
        pad[:n, :k] = w
        blocks = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)
        scale_inv = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        q = (blocks / scale_inv[:, None, :, None]).view_as(pad)[:n, :k].to(torch.float8_e4m3fn)
        out[name] = q
        out[name[:-len("weight")] + "weight_scale_inv"] = scale_inv
        full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
        ref[name[:-len(".weight")]] = q.to(torch.float32) * full
    save_file(out, str(dst / "model.safetensors"))
    return ref


def write_compressed_tensors(src: Path, dst: Path, kind: str) -> dict[str, torch.Tensor]:
    """kind: fp8-channel | int4-sym | int4-asym, through compressed-tensors' own code."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams

    if kind == "fp8-channel":
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        fmt = "float-quantized"
    else:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=kind == "int4-sym", strategy="group",
                                group_size=32)
        fmt = "pack-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"])
    tensors = _copy_rest(src, dst, config.model_dump(mode="json"))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    out, ref = {}, {}
    for name, w in tensors.items():
        if not _is_proj(name):
            out[name] = w
            continue
        prefix = name[:-len(".weight")]
        if kind == "fp8-channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            g = w.view(w.shape[0], -1, 32)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale, zp = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp.to(args.pytorch_dtype())}
        compressed = compressor.compress(state, scheme)
        for key, value in compressed.items():
            out[f"{prefix}.{key}"] = value
        ref[prefix] = dequantize(
            x_q=_quantized_values(compressed, kind, w.shape), scale=scale, zero_point=zp, args=args
        ).to(torch.float32)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    return ref


def _quantized_values(compressed: dict, kind: str, shape) -> torch.Tensor:
    if kind == "fp8-channel":
        return compressed["weight"]
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(compressed["weight_packed"], 4, torch.Size(shape))


def _int4_qparams(w: torch.Tensor, group: int, sym: bool):
    """[N, K] -> codes [N, K] 0..15, scale [N, K/G], zero [N, K/G] (integers 0..15)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    if sym:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half().float()
    codes = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).view(n, k).to(torch.int32)
    return codes, scale, zero


def _pack_cols(values: torch.Tensor, order) -> torch.Tensor:
    """int [R, C] -> int32 [R, C/8]: nibble i of word c holds column 8c + order[i]."""
    r, c = values.shape
    v = values.to(torch.int64).view(r, c // 8, 8)
    word = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        word |= v[:, :, order[i]] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def write_awq(src: Path, dst: Path, group: int = 32) -> dict[str, torch.Tensor]:
    tensors = _copy_rest(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                    "version": "gemm"})
    out, ref = {}, {}
    for name, w in tensors.items():
        if not _is_proj(name):
            out[name] = w
            continue
        prefix = name[:-len(".weight")]
        codes, scale, zero = _int4_qparams(w, group, sym=False)
        out[f"{prefix}.qweight"] = _pack_cols(codes.t().contiguous(), AWQ_ORDER)  # [K, N/8]
        out[f"{prefix}.qzeros"] = _pack_cols(zero.t().to(torch.int32).contiguous(), AWQ_ORDER)  # [K/G, N/8]
        out[f"{prefix}.scales"] = scale.t().contiguous().half()  # [K/G, N]
        ref[prefix] = reference_awq(out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"], out[f"{prefix}.scales"], group)
    save_file(out, str(dst / "model.safetensors"))
    return ref


def write_gptq(src: Path, dst: Path, group: int = 32, sym: bool = True, act_order: bool = False,
               seed: int = 0) -> dict[str, torch.Tensor]:
    tensors = _copy_rest(src, dst, {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                    "desc_act": act_order, "checkpoint_format": "gptq"})
    gen = torch.Generator().manual_seed(seed)
    out, ref = {}, {}
    for name, w in tensors.items():
        if not _is_proj(name):
            out[name] = w
            continue
        prefix = name[:-len(".weight")]
        n, k = w.shape
        # act-order: columns are quantized in a permuted order, group j = the j-th G columns of that order
        perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        codes_p, scale, zero = _int4_qparams(w[:, perm].contiguous(), group, sym)
        codes = torch.empty_like(codes_p)
        codes[:, perm] = codes_p
        qweight = torch.zeros(k // 8, n, dtype=torch.int64)  # AutoGPTQ: row r holds input rows 8r..8r+7
        ct = codes.t().to(torch.int64)
        for i in range(8):
            qweight |= ct[i::8] << (4 * i)
        out[f"{prefix}.qweight"] = torch.where(qweight >= 2**31, qweight - 2**32, qweight).to(torch.int32)
        out[f"{prefix}.qzeros"] = _pack_cols((zero.t() - 1).to(torch.int32) & 0xF, list(range(8)))  # v1: zero - 1
        out[f"{prefix}.scales"] = scale.t().contiguous().half()
        out[f"{prefix}.g_idx"] = g_idx
        ref[prefix] = reference_gptq(out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"], out[f"{prefix}.scales"], g_idx)
    save_file(out, str(dst / "model.safetensors"))
    return ref


def reference_awq(qweight, qzeros, scales, group) -> torch.Tensor:
    """AutoAWQ's dequantize (GEMM): unpack with the reverse order [0,4,1,5,2,6,3,7], w = (q - z) * s; [N, K]."""
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack(p):
        shifts = torch.arange(0, 32, 4)
        nib = (p.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] in bit order
        return nib[:, :, reverse].reshape(p.shape[0], -1)  # column 8c + j is nibble reverse[j]

    q, z = unpack(qweight).float(), unpack(qzeros).float()
    s = scales.float()
    z = z.repeat_interleave(group, 0)
    s = s.repeat_interleave(group, 0)
    return ((q - z) * s).t().contiguous()


def reference_gptq(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """AutoGPTQ's dequantize: zeros = unpack(qzeros) + 1, w[k] = s[g_idx[k]] * (q[k] - zeros[g_idx[k]]); [N, K]."""
    k = qweight.shape[0] * 8
    q = torch.stack([(qweight.to(torch.int64) >> (4 * (r % 8)))[r // 8] & 0xF for r in range(k)]).float()
    shifts = torch.arange(0, 32, 4)
    zeros = (((qzeros.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(qzeros.shape[0], -1) + 1).float()
    gi = g_idx.long()
    return (scales.float()[gi] * (q - zeros[gi])).t().contiguous()
