"""Triton kernels for the quantized layouts at decode: a skinny matmul that streams the quantized bytes.

    y = quant_linear(x, layer)          # x [..., K] (1 to MAX_ROWS rows, bf16/fp16) -> [..., N]
    y = quant_linear(x, layer, config)  # at another launch shape (`strata-engine bench linear --quant`)

A decode step multiplies a few rows by each weight: the product streams the weight's bytes, so it runs at the
speed of the quantized bytes only if they are expanded after the load, in registers, never written back to
memory as bf16, and only if enough of them are in flight to cover the memory's latency. Each program owns
BLOCK_N output columns and one of SPLIT slices of K, walked in BLOCK_K steps; every row of the step is one
[BLOCK_M, BLOCK_K] tile, so the weight is read once whatever the row count. The launch shape is a function of
the weight's shape only (`default_config`): enough programs to keep every SM streaming (K split where the output
is narrow), never of the row count, so a row's output does not depend on the other rows of the step (a verify
step computes a token's projections exactly as a decode step does).

The design follows Marlin (vLLM's 4-bit kernel) and the block-FP8 Triton kernels of vLLM and SGLang where Triton
lets it: codes stay packed in memory and are expanded in registers, and the scales are applied where they are
cheapest, to the fp32 partial products rather than to every weight:
- fp8, a scale per channel: the e4m3 bytes convert to the activations' dtype (exact: every e4m3 value is a
  bf16 / fp16 value), the tensor cores multiply, the column's scale multiplies the sum once at the end;
- fp8, blocks of 128 along K (Qwen's 128x128): the partial product of each step times its block's scale
  (vLLM's `acc += dot(a, b) * scale`), one scale per column per step;
- int4 / int8, a group that spans whole steps (group 128 and up): the codes convert exactly to the
  activations' dtype (4-bit bf16 codes by Marlin's magic number: the code in the mantissa of 128.0, minus 128),
  and `u * scale + offset` per group becomes `dot(x, u) * scale + sum(x) * offset` per step;
- other shapes (GGUF's groups of 32 and 16, odd FP8 blocks): the weight tile is expanded with its scales
  element by element before the product (the general path).
Split K: each split stores an fp32 partial sum, and the last of a tile's splits to finish adds them in split
order (the counters of engine.model.triton_linear), so the result is deterministic. No host synchronisation and
no allocation but the output and the partial sums: the launches are capturable in CUDA graphs. The same kernels
run in Triton's interpreter on CPU (the tests' oracle is the layer's `reference`).

Prompt chunks (more rows) take the reference path (dequantize, then cuBLAS), where the matmul is compute-bound;
per-channel FP8 on Hopper multiplies in FP8 there with torch._scaled_mm (rows quantized per token).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.model.triton_linear import COUNTER_LANES, split_counters

FP8_MAX = 448.0  # the largest finite e4m3 value
_MIN_BLOCK_M = 16  # the tensor cores' smallest row tile
_TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): enough loads in flight to stream the weight
_MIN_STEPS_PER_SPLIT = 4  # a split shorter than this many K steps spends more on its partial sum than it saves

# how a layer's scales reach the product (constexpr SCALES of the kernels)
SCALE_PER_COLUMN = 0  # fp8: one scale per output column, applied to the finished sum
SCALE_PER_STEP = 1  # one scale (int: and offset) per column per K step, applied to the step's partial product
SCALE_PER_ELEMENT = 2  # the general path: the weight tile expanded with its scales before the product


@dataclass(frozen=True)
class QuantConfig:
    """Launch shape: output columns per program, K per loop step, K splits (1: no partial sums), warps, stages."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: a power of two, at least 16 (the tensor cores' tile)")

    def label(self) -> str:
        return f"{self.block_n}x{self.block_k}x{self.split_k}x{self.num_warps}x{self.num_stages}"


@triton.jit
def _int_group_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                      stride_xm, stride_qn, stride_sn, stride_om,
                      GROUP: tl.constexpr, BITS: tl.constexpr, SCALES: tl.constexpr, MAGIC_BF16: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    q_rows = q_ptr + rn64[:, None] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if BITS == 4:
            # one int32 word per 8 codes along K, code j in bits 4j: each word is repeated 8 times in registers
            # (interleave: no shared-memory round trip), then shifted to its code
            ws = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(q_rows + ws[None, :], mask=n_ok[:, None] & (ws < K // 8)[None, :], other=0)
            words = tl.interleave(words, words)
            words = tl.interleave(words, words)
            words = tl.interleave(words, words)
            codes = (words >> ((tl.arange(0, BLOCK_K) % 8) * 4)[None, :]) & 0xF
        else:
            codes = tl.load(q_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
        if SCALES == 1:  # the step lies in one group: u * s + o summed over the step is s * x.u + o * sum(x)
            g = k0 // GROUP
            s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            if MAGIC_BF16:  # bf16 bits 0x4300 | u are 128 + u (Marlin's trick): no integer-to-float conversion
                w = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
            else:
                w = codes.to(x.dtype)
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            acc += part * s[None, :] + x_sum[:, None] * o[None, :]
        else:
            if GROUP % BLOCK_K == 0:  # one scale per column (a group longer than a step, K not a multiple)
                g = k0 // GROUP
                s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                o = tl.load(o_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            elif BLOCK_K % GROUP != 0:  # groups that straddle steps (one group of a K that is no power of two)
                gk = n_ok[:, None] & k_ok[None, :]
                gi = rn64[:, None] * stride_sn + (ks // GROUP)[None, :]
                s = tl.load(s_ptr + gi, mask=gk, other=0.0).to(tl.float32)
                o = tl.load(o_ptr + gi, mask=gk, other=0.0).to(tl.float32)
            else:  # BLOCK_K // GROUP groups in the step, each broadcast over its GROUP codes
                gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                g_ok = n_ok[:, None] & (gs < K // GROUP)[None, :]
                s = tl.load(s_ptr + rn64[:, None] * stride_sn + gs[None, :], mask=g_ok, other=0.0).to(tl.float32)
                o = tl.load(o_ptr + rn64[:, None] * stride_sn + gs[None, :], mask=g_ok, other=0.0).to(tl.float32)
                s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
                o = tl.reshape(tl.broadcast_to(o[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
            w = (codes.to(tl.float32) * s + o).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
    _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om, SPLIT, HAS_BIAS)


@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                stride_xm, stride_wn, stride_sn, stride_om,
                SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, SCALES: tl.constexpr,
                NATIVE_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (rn // SCALE_BLOCK_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        tile_ok = n_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NATIVE_FP8:  # the hardware's conversion (sm_89 and up): exact, every e4m3 value is a bf16 / fp16 one
            w = tl.load(w_rows + ks[None, :], mask=tile_ok, other=0.0).to(x.dtype)
        else:  # older GPUs: the byte's exponent rebiased and mantissa moved into an fp32's (no fp32 denormal is
            # ever made, so a flush-to-zero device agrees); a subnormal (e = 0) is m * 2^-9
            bits = tl.load(w_rows + ks[None, :], mask=tile_ok, other=0).to(tl.int32)
            mag = bits & 0x7F
            normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
            w = tl.where(mag >= 8, normal, (mag & 7).to(tl.float32) * 0.001953125)  # 2^-9
            w = tl.where((bits & 0x80) != 0, -w, w)
        if SCALES == 2:
            s = tl.load(s_rows[:, None] + (ks // SCALE_BLOCK_K)[None, :], mask=tile_ok, other=0.0)
            acc += tl.dot(x, tl.trans((w.to(tl.float32) * s).to(x.dtype)))
        elif SCALES == 1:
            s = tl.load(s_rows + k0 // SCALE_BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s[None, :]
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if SCALES == 0:
        acc = acc * tl.load(s_rows, mask=n_ok, other=0.0)[None, :]
    _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om, SPLIT, HAS_BIAS)


@triton.jit
def _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om,
            SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    tile_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:
        # Each split stores its fp32 partial sum; the last of the tile's splits to finish (the counter's acq_rel
        # add orders the others' stores before its loads) adds all of them in split order and sets the counter
        # back to 0 for the next launch (engine.model.triton_linear's protocol).
        parts = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(parts + split * M * N, acc, mask=tile_ok)
        counter = count_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        tl.debug_barrier()
        if tl.atomic_add(counter, 1) == SPLIT - 1:
            tl.debug_barrier()
            acc = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT):
                acc += tl.load(parts + s * M * N, mask=tile_ok, other=0.0, cache_modifier=".cg")
            _store(acc, b_ptr, out_ptr, rm, rn, n_ok, tile_ok, stride_om, HAS_BIAS)
            tl.atomic_xchg(counter, 0)
    else:
        _store(acc, b_ptr, out_ptr, rm, rn, n_ok, tile_ok, stride_om, HAS_BIAS)


@triton.jit
def _store(acc, b_ptr, out_ptr, rm, rn, n_ok, tile_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


def scale_mode(layer, block_k: int) -> int:
    """How `layer`'s scales reach the product at steps of `block_k` (SCALE_PER_*)."""
    if layer.format == "fp8":
        if layer.block_k >= layer.in_features:
            return SCALE_PER_COLUMN
        return SCALE_PER_STEP if layer.block_k % block_k == 0 else SCALE_PER_ELEMENT
    return SCALE_PER_STEP if layer.group_size % block_k == 0 and layer.in_features % block_k == 0 \
        else SCALE_PER_ELEMENT


def default_config(layer) -> QuantConfig:
    """The launch shape for `layer` (its shape and layout only, never the row count): a step of 128 codes (a
    block-FP8 scale block, an int4 group) or 256 (per-channel FP8), BLOCK_N columns per program, and K split
    until there are about two programs per SM, each a few steps long."""
    n, k = layer.out_features, layer.in_features
    if layer.format == "fp8":
        block_n = 32
        block_k = 256 if layer.block_k >= k else 128
    else:
        block_n = 64
        block_k = 128
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < _TARGET_PROGRAMS and k // (split * 2) >= _MIN_STEPS_PER_SPLIT * block_k:
        split *= 2
    return QuantConfig(block_n=block_n, block_k=block_k, split_k=split)


@functools.lru_cache(maxsize=None)
def _native_fp8(device: torch.device) -> bool:
    """Whether the device converts e4m3 in hardware (sm_89 and up; Triton's interpreter on CPU does too)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _layer_launch(layer) -> tuple[QuantConfig, int]:
    """The layer's default launch shape and scale mode, worked out at its first product and kept on it."""
    launch = layer.__dict__.get("_quant_launch")
    if launch is None:
        cfg = default_config(layer)
        launch = layer.__dict__["_quant_launch"] = (cfg, scale_mode(layer, cfg.block_k))
    return launch


def prepare(device: torch.device | str) -> None:
    """Make every lane's split counters on `device` (before any CUDA graph capture of a quantized model)."""
    for lane in COUNTER_LANES:
        split_counters(device, lane)


def quant_linear(x: torch.Tensor, layer, config: QuantConfig | None = None) -> torch.Tensor:
    """layer(x) through the kernel of its layout (engine.model.quant.linear's layers, told apart by `format`, so
    this module needs no import of them), any row count: the tests run it on CPU in the interpreter."""
    is_int = layer.format in ("int4", "int8")
    if is_int and layer.perm is not None:
        x = x.index_select(-1, layer.perm)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = layer.out_features
    assert k == layer.in_features, (tuple(x.shape), k, layer.in_features)
    cfg, scales = (config, scale_mode(layer, config.block_k)) if config is not None else _layer_launch(layer)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, block_m))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
        assert grid[0] * grid[2] <= counters.numel(), (n, m, cfg)
    else:
        part = counters = out
    has_bias = layer.bias is not None
    # a taller row tile keeps fewer steps in flight (its activation tiles fill the shared memory a step's
    # pipeline holds); the stages change when loads are issued, never the order of the sums
    stages = max(2, cfg.num_stages - (block_m // 32))
    launch = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split_k, HAS_BIAS=has_bias,
                  num_warps=cfg.num_warps, num_stages=stages)
    if is_int:
        _int_group_kernel[grid](
            rows, layer.qweight, layer.scales, layer.offsets, layer.bias if has_bias else layer.scales, out, part,
            counters, m, n, k, k_per_split, rows.stride(0), layer.qweight.stride(0), layer.scales.stride(0),
            out.stride(0), GROUP=layer.group_size, BITS=layer.bits, SCALES=scales,
            MAGIC_BF16=layer.bits == 4 and x.dtype == torch.bfloat16, **launch,
        )
    elif layer.format == "fp8":
        native = _native_fp8(x.device)
        _fp8_kernel[grid](
            rows, layer.weight if native else layer.weight.view(torch.uint8), layer.weight_scale,
            layer.bias if has_bias else layer.weight_scale, out, part, counters, m, n, k, k_per_split,
            rows.stride(0), layer.weight.stride(0), layer.weight_scale.stride(0), out.stride(0),
            SCALE_BLOCK_N=layer.block_n, SCALE_BLOCK_K=layer.block_k, SCALES=scales, NATIVE_FP8=native, **launch,
        )
    else:
        raise TypeError(f"no kernel for {type(layer).__name__}")
    return out.view(*x.shape[:-1], n)


def scaled_mm_takes(x: torch.Tensor, layer) -> bool:
    """Whether a prompt chunk through `layer` can multiply in FP8 (torch._scaled_mm, row-wise scales): per-channel
    FP8 on a Hopper-class device, sizes multiples of 16."""
    return (layer.format == "fp8" and x.is_cuda and layer.block_n == 1 and layer.block_k >= layer.in_features
            and x.dtype == torch.bfloat16 and layer.in_features % 16 == 0 and layer.out_features % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def scaled_mm_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Per-token FP8 activations times per-channel FP8 weights, bf16 out (as compressed-tensors' FP8_DYNAMIC)."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16, bias=layer.bias.to(torch.bfloat16) if layer.bias is not None else None)
    return out.view(*x.shape[:-1], layer.out_features)
