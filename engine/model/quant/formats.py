"""Quantized checkpoint formats (config.json's `quantization_config`) read into the internal layouts.

    scheme = scheme_from_config(raw_config, "DIR/config.json")   # None: an unquantized checkpoint
    layer = read_linear(source, "model.layers.0.self_attn.q_proj", scheme, (N, K), bias, device, scale_dtype)

`read_linear` returns None where the checkpoint stores that projection unquantized (`ignore` lists, lm_head),
and the loader then reads the plain `weight`. The formats and how each maps:

| quant_method | tensors per projection | layout |
|---|---|---|
| `fp8` (Qwen's `*-FP8`) | `weight` e4m3 [N, K], `weight_scale_inv` [N/128, K/128] | Fp8Linear, the checkpoint's blocks |
| `compressed-tensors`, float-quantized | `weight` e4m3, `weight_scale` [N, 1] / [1] / blocks | Fp8Linear (1 x K, N x K, blocks) |
| `compressed-tensors`, pack-quantized | `weight_packed` int32 [N, K*b/32], `weight_scale` [N, K/G], `weight_zero_point` (asym) | IntGroupLinear |
| `awq` (GEMM) | `qweight` [K, N/8], `qzeros` [K/G, N/8] (order 0,2,4,6,1,3,5,7), `scales` [K/G, N] | IntGroupLinear |
| `gptq` | `qweight` [K/8, N], `qzeros` [K/G, N/8] (v1 stores zero - 1), `scales` [K/G, N], `g_idx` [K] | IntGroupLinear (+ perm) |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import CheckpointError
from engine.model.quant.linear import Fp8Linear, IntGroupLinear, QuantLinear
from engine.model.tensors import TensorSource

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble j of a word holds column 8c + AWQ_ORDER[j]
METHODS = ("fp8", "compressed-tensors", "awq", "gptq")


@dataclass(frozen=True)
class Scheme:
    """What the loader needs to know of a checkpoint's quantization_config."""

    method: str
    where: str  # config.json's path, for errors
    bits: int = 8
    group_size: int = 128
    block: tuple[int, int] | None = None  # fp8: weight_block_size
    symmetric: bool = True
    gptq_v1_zeros: bool = True  # GPTQ's original format stores zero - 1

    def describe(self) -> str:
        """The weight format as the VRAM books and the load log show it."""
        if self.method == "fp8":
            return f"fp8 (block {self.block[0]}x{self.block[1]})" if self.block else "fp8"
        if self.method == "compressed-tensors":
            return f"compressed-tensors ({'fp8' if self.bits == 8 and self.group_size == 0 else f'int{self.bits}'})"
        return f"int{self.bits} ({self.method}, group {self.group_size})"


def scheme_from_config(raw: dict[str, Any], where: str) -> Scheme | None:
    """The Scheme of a config.json (its `quantization_config`), None without one; a CheckpointError naming the
    key for a method or setting no layout here can hold."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(where, "quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise CheckpointError(where, f"quantization_config.quant_method={method!r} is not supported "
                                     f"(supported: {', '.join(METHODS)})")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2):
            raise CheckpointError(where, f"quantization_config.weight_block_size={block!r}: expected [rows, cols]")
        return Scheme("fp8", where, block=tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4:
        raise CheckpointError(where, f"quantization_config.bits={bits}: {method} checkpoints load at 4 bits only")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(where, f"quantization_config.version={version!r}: only AWQ's GEMM packing loads")
        return Scheme("awq", where, bits=4, group_size=group, symmetric=not qc.get("zero_point", True))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    return Scheme("gptq", where, bits=4, group_size=group, symmetric=bool(qc.get("sym", True)),
                  gptq_v1_zeros=fmt != "gptq_v2")


def _compressed_tensors_scheme(qc: dict[str, Any], where: str) -> Scheme:
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if len(weights) != 1:
        raise CheckpointError(where, f"quantization_config.config_groups: expected one weight scheme, found "
                                     f"{len(weights)}")
    w = weights[0]
    fmt = str(next((g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")),
                   qc.get("format", ""))).lower()
    kind, bits, strategy = w.get("type"), int(w.get("num_bits", 8)), w.get("strategy")
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        block = w.get("block_structure")
        return Scheme("compressed-tensors", where, bits=8, group_size=0,
                      block=tuple(block) if strategy == "block" and block else None)
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
        group = int(w.get("group_size") or 0) if strategy == "group" else 0  # 0: one group of K
        return Scheme("compressed-tensors", where, bits=bits, group_size=group, symmetric=bool(w.get("symmetric", True)))
    raise CheckpointError(where, f"compressed-tensors format {fmt!r} with {kind} {bits}-bit {strategy} weights "
                                 "is not supported (float-quantized fp8, pack-quantized int4/int8 are)")


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # what a plain (unquantized) tensor may hold
_PACKED_DTYPES = ("I32", "U32")  # int4/int8 codes packed into 32-bit words
_FP8_DTYPE = "F8_E4M3"


def check_linear(source: TensorSource, prefix: str, scheme: Scheme, shape: tuple[int, int]) -> bool:
    """Whether the projection `prefix` ([N, K] = shape) is stored quantized, with every tensor it needs present
    and of the shape and dtype its format gives, from the headers alone (nothing is read but a 2-value
    `weight_shape`); False where it is stored plain (the loader then checks the plain `weight`). A
    CheckpointError names the file and tensor at fault, before anything is allocated for the model."""
    n, k = shape
    if scheme.method in ("fp8", "compressed-tensors") and f"{prefix}.weight" in source:
        if source.dtype(f"{prefix}.weight") != _FP8_DTYPE:
            return False  # an ignored layer, kept in 16 bits
        _expect(source, f"{prefix}.weight", (n, k))
        scale = f"{prefix}.weight_scale_inv" if scheme.method == "fp8" else f"{prefix}.weight_scale"
        _check_fp8_scale(source, scale, scheme, n, k)
        return True
    if scheme.method == "compressed-tensors" and f"{prefix}.weight_packed" in source:
        _check_compressed_int(source, prefix, scheme, n, k)
        return True
    if scheme.method in ("awq", "gptq") and f"{prefix}.qweight" in source:
        g = scheme.group_size if scheme.group_size > 0 else k
        if n % 8 or k % 8:
            raise CheckpointError(source.path_of(f"{prefix}.qweight"), f"tensor {prefix}.qweight packs [{n}, {k}]: "
                                                                       f"both must be multiples of 8")
        if scheme.method == "awq":
            if k % g:
                raise CheckpointError(scheme.where, f"quantization_config.group_size={g} does not divide K={k} of "
                                                    f"{prefix}")
            _expect(source, f"{prefix}.qweight", (k, n // 8), _PACKED_DTYPES)
            _expect(source, f"{prefix}.scales", (k // g, n), FLOAT_DTYPES)
            _expect(source, f"{prefix}.qzeros", (k // g, n // 8), _PACKED_DTYPES)
        else:
            groups = math.ceil(k / g)
            _expect(source, f"{prefix}.qweight", (k // 8, n), _PACKED_DTYPES)
            _expect(source, f"{prefix}.scales", (groups, n), FLOAT_DTYPES)
            _expect(source, f"{prefix}.qzeros", (groups, n // 8), _PACKED_DTYPES)
            if f"{prefix}.g_idx" in source:
                _expect(source, f"{prefix}.g_idx", (k,), ("I32", "I64"))
        return True
    return False


def _check_fp8_scale(source: TensorSource, name: str, scheme: Scheme, n: int, k: int) -> None:
    if scheme.block is not None:
        _expect(source, name, (math.ceil(n / scheme.block[0]), math.ceil(k / scheme.block[1])), FLOAT_DTYPES)
        return
    _require(source, name)
    got = source.shape(name)
    if got not in ((), (1,), (1, 1), (n,), (n, 1)):
        raise CheckpointError(source.path_of(name), f"tensor {name} has shape {list(got)}: expected [{n}, 1] (a "
                                                    f"scale per output row of the [{n}, {k}] weight) or [1] (one "
                                                    f"for the tensor)")
    _expect_dtype(source, name, FLOAT_DTYPES)


def _check_compressed_int(source: TensorSource, prefix: str, scheme: Scheme, n: int, k: int) -> None:
    bits = scheme.bits
    group = scheme.group_size or k
    if k % group:
        raise CheckpointError(scheme.where, f"quantization_config group_size={group} does not divide K={k} of {prefix}")
    _expect(source, f"{prefix}.weight_packed", (n, math.ceil(k * bits / 32)), _PACKED_DTYPES)
    _expect(source, f"{prefix}.weight_scale", (n, k // group), FLOAT_DTYPES)
    if not scheme.symmetric:  # zero points packed along dim 0 (output rows)
        _expect(source, f"{prefix}.weight_zero_point", (math.ceil(n * bits / 32), k // group), _PACKED_DTYPES)
    declared = f"{prefix}.weight_shape"
    if declared in source:
        _expect(source, declared, (2,), ("I32", "I64"))
        values = [int(v) for v in source.get(declared).tolist()]
        if values != [n, k]:
            raise CheckpointError(source.path_of(declared), f"tensor {declared} says the weight is {values}; the "
                                                            f"model's config gives [{n}, {k}]")


def _require(source: TensorSource, name: str) -> None:
    if name not in source:
        raise CheckpointError(source.where, f"missing tensor {name} (a quantized projection needs it)")


def _expect(source: TensorSource, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] | None = None) -> None:
    _require(source, name)
    _check_shape(source, name, source.shape(name), shape)
    if dtypes is not None:
        _expect_dtype(source, name, dtypes)


def _expect_dtype(source: TensorSource, name: str, dtypes: tuple[str, ...]) -> None:
    got = source.dtype(name)
    if got not in dtypes:
        raise CheckpointError(source.path_of(name), f"tensor {name} is {got}; expected {' or '.join(dtypes)}")


def read_linear(source: TensorSource, prefix: str, scheme: Scheme, shape: tuple[int, int],
                bias: torch.Tensor | None, device: torch.device, scale_dtype: torch.dtype) -> QuantLinear | None:
    """The projection `prefix` ([N, K] = shape) as a quantized layer, or None when it is stored plain. Every
    tensor is checked (check_linear) before any is read."""
    n, k = shape
    if not check_linear(source, prefix, scheme, shape):
        return None
    if scheme.method in ("fp8", "compressed-tensors") and f"{prefix}.weight" in source:
        weight = source.get(f"{prefix}.weight")
        scale_name = f"{prefix}.weight_scale_inv" if scheme.method == "fp8" else f"{prefix}.weight_scale"
        scale = source.get(scale_name).to(torch.float32)
        block = _fp8_block(scheme, scale, n, k)
        return Fp8Linear(weight, scale.reshape(math.ceil(n / block[0]), math.ceil(k / block[1])), block,
                         bias).to(device)
    if scheme.method == "compressed-tensors":
        return _compressed_int(source, prefix, scheme, n, k, bias, scale_dtype).to(device)
    if scheme.method == "awq":
        return _awq(source, prefix, scheme, n, k, bias, scale_dtype).to(device)
    return _gptq(source, prefix, scheme, n, k, bias, scale_dtype).to(device)


def _check_shape(source: TensorSource, name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise CheckpointError(source.path_of(name), f"tensor {name} has shape {list(got)}, expected {list(expected)}")


def _fp8_block(scheme: Scheme, scale: torch.Tensor, n: int, k: int) -> tuple[int, int]:
    """The block one scale covers (check_linear has held the scale to one of these layouts)."""
    if scheme.block is not None:
        return int(scheme.block[0]), int(scheme.block[1])
    return (n, k) if scale.numel() == 1 else (1, k)


def unpack_dense(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense int32 packing along the last dim (value j at bits j*b of the row's bit
    stream; 4 and 8 bits never straddle a word) -> unsigned codes [..., count]."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)[..., :count]


def _compressed_int(source, prefix, scheme: Scheme, n, k, bias, scale_dtype) -> IntGroupLinear:
    bits = scheme.bits
    packed = source.get(f"{prefix}.weight_packed")
    codes = unpack_dense(packed, bits, k)  # value + 2^(b-1): the library's unsigned offset
    scale = source.get(f"{prefix}.weight_scale").to(torch.float32)
    group = scheme.group_size or k
    mid = 1 << (bits - 1)
    if scheme.symmetric:
        zero = torch.full_like(scale, float(mid))
    else:  # zero points packed along dim 0 (output rows), in the signed range
        zp = source.get(f"{prefix}.weight_zero_point")
        zero = unpack_dense(zp.t().contiguous(), bits, n).t().to(torch.float32)
    return IntGroupLinear(codes, scale, -zero * scale, bits, group, bias, scale_dtype=scale_dtype)


def _awq(source, prefix, scheme: Scheme, n, k, bias, scale_dtype) -> IntGroupLinear:
    g = scheme.group_size if scheme.group_size > 0 else k
    qweight, qzeros, scales = (source.get(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales"))
    codes = _unpack_columns(qweight, AWQ_ORDER)  # [K, N]
    zeros = _unpack_columns(qzeros, AWQ_ORDER).to(torch.float32)  # [K/G, N]
    s = scales.to(torch.float32)
    return IntGroupLinear(codes.t(), s.t(), (-zeros * s).t(), 4, g, bias, scale_dtype=scale_dtype)


def _gptq(source, prefix, scheme: Scheme, n, k, bias, scale_dtype) -> IntGroupLinear:
    g = scheme.group_size if scheme.group_size > 0 else k
    qweight, qzeros, scales = (source.get(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales"))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((qweight.to(torch.int32).unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(k, n)  # [K, N]
    zeros = _unpack_columns(qzeros, tuple(range(8))).to(torch.float32) + (1 if scheme.gptq_v1_zeros else 0)
    s = scales.to(torch.float32)
    g_idx = source.get(f"{prefix}.g_idx").to(torch.int64) if f"{prefix}.g_idx" in source else None
    perm = None
    if g_idx is not None and not torch.equal(g_idx, torch.arange(k) // g):  # act-order: sort the columns by group
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(k) // g):
            raise CheckpointError(source.path_of(f"{prefix}.g_idx"),
                                  f"tensor {prefix}.g_idx does not give every group {g} columns")
        codes = codes[perm]
    return IntGroupLinear(codes.t(), s.t(), (-zeros * s).t(), 4, g, bias, perm=perm, scale_dtype=scale_dtype)


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] packing 8 columns per word (nibble j holds column 8c + order[j]) -> int32 [R, 8C]."""
    r, c = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] in nibble order
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(r, c * 8)
