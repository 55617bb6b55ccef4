"""Triton kernels for the quantized layouts at decode: a skinny matmul that dequantizes in registers.

    y = quant_linear(x, layer)   # x [..., K] (1 to MAX_ROWS rows, bf16/fp16) -> [..., N]

A decode step multiplies a few rows by each weight: the product streams the weight's bytes, so it runs at the
speed of the quantized bytes only if they are expanded after the load, in registers, never written back to
memory as bf16. Each program owns BLOCK_N output columns and walks K in BLOCK_K steps: it loads the codes
(4-bit: one int32 word per 8 codes; 8-bit: one byte each; fp8: one byte each), the step's scales (one per
group, broadcast over the group), builds the bf16 tile of the weight and feeds the tensor cores with every row
of the step in one [BLOCK_M, BLOCK_K] tile, so the weight is read once whatever the row count. The design is
Marlin's idea (codes stay packed in memory, expansion in registers) without its hand-tuned layout: the codes
keep the loader's row-major packing, so one kernel serves AWQ, GPTQ, compressed-tensors and GGUF weights.

e4m3 bytes are expanded with integer arithmetic (the byte's exponent, rebiased, and mantissa moved into an
fp32's; subnormals as m * 2^-9): exact for every finite e4m3 value, and the same code runs in Triton's
interpreter on CPU (the tests' oracle), which has no fp8 type. No host synchronisation and no allocation but the output:
the launches are capturable in CUDA graphs.

Prompt chunks (more rows) take the reference path (dequantize, then cuBLAS), where the matmul is compute-bound;
per-channel FP8 on Hopper multiplies in FP8 there with torch._scaled_mm (rows quantized per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


FP8_MAX = 448.0  # the largest finite e4m3 value
_MIN_BLOCK_M = 16  # the tensor cores' smallest row tile


@triton.jit
def _int_group_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
                      stride_om, GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if BITS == 4:
            ws = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(q_ptr + rn64[:, None] * stride_qn + ws[None, :],
                            mask=n_ok[:, None] & (ws < K // 8)[None, :], other=0)
            shifts = tl.arange(0, 8) * 4
            codes = (words[:, :, None] >> shifts[None, None, :]) & 0xF
            codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
        else:
            codes = tl.load(q_ptr + rn64[:, None] * stride_qn + ks[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
        if GROUP % BLOCK_K == 0:  # one group covers the step: one scale per column
            g = k0 // GROUP
            s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            o = tl.load(o_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        elif BLOCK_K % GROUP != 0:  # groups that straddle steps (one group of a K that is no power of two)
            gk = n_ok[:, None] & k_ok[None, :]
            s = tl.load(s_ptr + rn64[:, None] * stride_sn + (ks // GROUP)[None, :], mask=gk, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn64[:, None] * stride_sn + (ks // GROUP)[None, :], mask=gk, other=0.0).to(tl.float32)
        else:  # BLOCK_K // GROUP groups in the step, each broadcast over its GROUP codes
            gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            g_ok = n_ok[:, None] & (gs < K // GROUP)[None, :]
            s = tl.load(s_ptr + rn64[:, None] * stride_sn + gs[None, :], mask=g_ok, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn64[:, None] * stride_sn + gs[None, :], mask=g_ok, other=0.0).to(tl.float32)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
            o = tl.reshape(tl.broadcast_to(o[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
        w = (codes.to(tl.float32) * s + o).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    _store(acc, b_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS)


@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    s_rows = s_ptr + (rn // SCALE_BLOCK_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        tile_ok = n_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bits = tl.load(w_ptr + rn64[:, None] * stride_wn + ks[None, :], mask=tile_ok, other=0).to(tl.int32)
        # a normal e4m3 (exponent field e > 0) is an fp32 with exponent e + 120 and the same 3 mantissa bits; a
        # subnormal (e = 0) is m * 2^-9. No fp32 denormal is ever made, so a flush-to-zero device agrees.
        mag = bits & 0x7F
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        w = tl.where(mag >= 8, normal, (mag & 7).to(tl.float32) * 0.001953125)  # 2^-9
        w = tl.where((bits & 0x80) != 0, -w, w)
        s = tl.load(s_rows[:, None] + (ks // SCALE_BLOCK_K)[None, :], mask=tile_ok, other=0.0)
        w = (w * s).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    _store(acc, b_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS)


@triton.jit
def _store(acc, b_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_n(n: int) -> int:
    return 32 if n >= 8192 else 16


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """layer(x) through the kernel of its layout (engine.model.quant.linear's layers, told apart by `format`, so
    this module needs no import of them), any row count: the tests run it on CPU in the interpreter."""
    is_int = layer.format in ("int4", "int8")
    if is_int and layer.perm is not None:
        x = x.index_select(-1, layer.perm)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = layer.out_features
    assert k == layer.in_features, (tuple(x.shape), k, layer.in_features)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(m))
    block_n = _block_n(n)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    has_bias = layer.bias is not None
    if is_int:
        block_k = 128  # a group of 16..128 divides it, a larger one is a multiple of it or straddles steps
        _int_group_kernel[grid](
            rows, layer.qweight, layer.scales, layer.offsets, layer.bias if has_bias else layer.scales, out,
            m, n, k, rows.stride(0), layer.qweight.stride(0), layer.scales.stride(0), out.stride(0),
            GROUP=layer.group_size, BITS=layer.bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            HAS_BIAS=has_bias, num_warps=4, num_stages=3,
        )
    elif layer.format == "fp8":
        _fp8_kernel[grid](
            rows, layer.weight.view(torch.uint8), layer.weight_scale, layer.bias if has_bias else layer.weight_scale,
            out, m, n, k, rows.stride(0), layer.weight.stride(0), layer.weight_scale.stride(0), out.stride(0),
            SCALE_BLOCK_N=layer.block_n, SCALE_BLOCK_K=layer.block_k, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=128, HAS_BIAS=has_bias, num_warps=4, num_stages=3,
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
