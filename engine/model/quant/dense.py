"""Prompt chunks through quantized weights: the path of a product with more rows than the tensor-core kernels take.

A chunk of hundreds of rows is compute-bound, so it should run on cuBLAS's tuned GEMMs, not on a kernel that
expands the weight in registers for every tile of rows:
- FP8 with a scale per channel: the rows quantized per token, then torch._scaled_mm in FP8 (row-wise scales);
- FP8 in Qwen's 128x128 blocks: the rows quantized per token and block of 128, then cuBLAS's block-scaled FP8
  GEMM (torch's scaled_mm, BlockWise1x128 x BlockWise128x128; CUDA 12.9 and Hopper), where `prepare` found it
  to work on the device, else as the integer layouts:
- everything else: one Triton kernel writes the bf16 (fp16) weight, then one cuBLAS GEMM.
The rows' quantization is one Triton kernel too (the amax and the cast of each row's block), where the torch ops
would be six launches and as many passes over the rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.model.quant.block_scales import blockwise_scales
from engine.model.quant.gemv import code_f32

FP8_MAX = 448.0
_DEQUANT_BLOCK_N = 32
_DEQUANT_BLOCK_K = 256  # fp8 weights of one program's row slab
# The integer kernel's tile: 16 rows of 64 words (512 4-bit weights a row); the sm_90 compile test
# (tests/engine/model/test_quant_kernels_compile.py) checks that its registers fit
_DEQUANT_INT_BLOCK_N = 16
_DEQUANT_INT_BLOCK_W = 64
_QUANT_BLOCK = 128  # activations per step of the rows' quantization


@triton.jit
def _cat_last(a, b):
    """[R, C, L] and [R, C, L] -> [R, C, 2L]: a's values then b's, in the thread that holds them."""
    ab = tl.join(a, b)  # [R, C, L, 2]
    return tl.reshape(tl.trans(ab, 0, 1, 3, 2), (ab.shape[0], ab.shape[1], 2 * ab.shape[2]))


@triton.jit
def _dequant_int_kernel(q_ptr, s_ptr, o_ptr, out_ptr, N, K, KW, stride_qn, stride_sn, stride_on,
                        GROUP: tl.constexpr, BITS: tl.constexpr, RUN: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    # One program per [BLOCK_N, BLOCK_W] tile of the words, read once as 16-byte vectors (a run of RUN words lies in
    # one group: one scale and offset a run). Slot j of a run's words is the run's inputs RUN*j .. RUN*j + RUN - 1
    # (kernel_pack's layout), so the run's RUN * CPW values are put in input order in registers and stored whole,
    # each warp writing whole sectors. Storing slot by slot instead writes RUN * 2 bytes per run and store: a warp's
    # store then fills a quarter of each 32-byte sector it touches (int4), four times the L2 write requests a copy
    # of the same bytes makes.
    CPW: tl.constexpr = 32 // BITS
    RUNS: tl.constexpr = BLOCK_W // RUN
    tl.static_assert(CPW == 8 or CPW == 4, "the integer layouts are 4- and 8-bit")
    rr = tl.program_id(0) * RUNS + tl.arange(0, RUNS)  # along K first: neighbouring programs write
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # neighbouring pieces of the same rows
    rn64 = rn.to(tl.int64)
    ws = rr[:, None] * RUN + tl.arange(0, RUN)[None, :]  # [RUNS, RUN]
    words = tl.load(q_ptr + rn64[:, None, None] * stride_qn + ws[None, :, :],
                    mask=(rn < N)[:, None, None] & (ws < KW)[None, :, :], other=0)
    g = (rr * (RUN * CPW)) // GROUP
    run_ok = (rn < N)[:, None] & (rr * RUN < KW)[None, :]
    s = tl.load(s_ptr + rn64[:, None] * stride_sn + g[None, :], mask=run_ok, other=0.0).to(tl.float32)[:, :, None]
    o = tl.load(o_ptr + rn64[:, None] * stride_sn + g[None, :], mask=run_ok, other=0.0).to(tl.float32)[:, :, None]
    ty = out_ptr.dtype.element_ty
    # slot j's codes, shifted down: the exact fp32 code, then the reference's arithmetic and one rounding
    v0 = (code_f32(words, BITS, 0) * s + o).to(ty)
    v1 = (code_f32(words >> BITS, BITS, 0) * s + o).to(ty)
    v2 = (code_f32(words >> (2 * BITS), BITS, 0) * s + o).to(ty)
    v3 = (code_f32(words >> (3 * BITS), BITS, 0) * s + o).to(ty)
    vals = _cat_last(_cat_last(v0, v1), _cat_last(v2, v3))
    if CPW == 8:
        v4 = (code_f32(words >> (4 * BITS), BITS, 0) * s + o).to(ty)
        v5 = (code_f32(words >> (5 * BITS), BITS, 0) * s + o).to(ty)
        v6 = (code_f32(words >> (6 * BITS), BITS, 0) * s + o).to(ty)
        v7 = (code_f32(words >> (7 * BITS), BITS, 0) * s + o).to(ty)
        vals = _cat_last(vals, _cat_last(_cat_last(v4, v5), _cat_last(v6, v7)))
    ks = rr[:, None] * (RUN * CPW) + tl.arange(0, RUN * CPW)[None, :]  # [RUNS, RUN * CPW]: the run's inputs
    tl.store(out_ptr + rn64[:, None, None] * stride_on + ks[None, :, :], vals,
             mask=(rn < N)[:, None, None] & (ks < K)[None, :, :])


@triton.jit
def _dequant_fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                        SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, TILE_IN_ONE_BLOCK: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn64 = rn.to(tl.int64)
    tile_ok = (rn < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + rn64[:, None] * stride_wn + ks[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    s_rows = s_ptr + (rn // SCALE_BLOCK_N).to(tl.int64) * stride_sn
    if TILE_IN_ONE_BLOCK:  # every column of the tile in one scale block (per channel, or blocks a tile wide): a
        # scale a row, where a gather per weight costs a load instruction for each
        s = tl.load(s_rows + (tl.program_id(1) * BLOCK_K) // SCALE_BLOCK_K, mask=rn < N, other=0.0)[:, None]
    else:
        s = tl.load(s_rows[:, None] + (ks // SCALE_BLOCK_K)[None, :], mask=tile_ok, other=0.0)
    tl.store(out_ptr + rn64[:, None] * stride_on + ks[None, :], (w * s).to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, group_len, stride_xm, stride_qm, stride_sm, stride_sg,
                          BLOCK: tl.constexpr):
    """Row m's inputs [g * group_len, (g + 1) * group_len) to e4m3 with one scale (amax / 448)."""
    m = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group_len
    end = tl.minimum(start + group_len, K)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + ks, mask=ks < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    for k0 in range(start, end, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + ks, mask=ks < end, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + m * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ks < end)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale)


def dequantize(layer, dtype: torch.dtype) -> torch.Tensor:
    """The layer's [N, K] weight in `dtype`, written by one kernel (the reference's arithmetic, fp32 then one
    rounding)."""
    n, k = layer.out_features, layer.in_features
    out = torch.empty(n, k, dtype=dtype, device=layer.scale_device)
    if layer.format == "fp8":
        if not _native_fp8(out.device):  # Triton converts e4m3 on sm_89 and up only
            return layer.dequantize(dtype)
        # a tile as wide as a scale block where blocks are narrower than the default tile (Qwen's 128)
        block_k = layer.block_k if 16 <= layer.block_k < _DEQUANT_BLOCK_K and triton.next_power_of_2(
            layer.block_k) == layer.block_k else _DEQUANT_BLOCK_K
        grid = (triton.cdiv(n, _DEQUANT_BLOCK_N), triton.cdiv(k, block_k))
        weight = layer.weight
        _dequant_fp8_kernel[grid](weight, layer.weight_scale, out, n, k, weight.stride(0),
                                  layer.weight_scale.stride(0), out.stride(0), SCALE_BLOCK_N=layer.block_n,
                                  SCALE_BLOCK_K=layer.block_k, BLOCK_N=_DEQUANT_BLOCK_N, BLOCK_K=block_k,
                                  TILE_IN_ONE_BLOCK=layer.block_k >= k or layer.block_k % block_k == 0)
        return out
    qweight = layer.qweight
    grid = (triton.cdiv(qweight.shape[1], _DEQUANT_INT_BLOCK_W), triton.cdiv(n, _DEQUANT_INT_BLOCK_N))
    _dequant_int_kernel[grid](qweight, layer.scales, layer.offsets, out, n, k, qweight.shape[1], qweight.stride(0),
                              layer.scales.stride(0), out.stride(0), GROUP=layer.group_size, BITS=layer.bits,
                              RUN=layer.run, BLOCK_N=_DEQUANT_INT_BLOCK_N, BLOCK_W=_DEQUANT_INT_BLOCK_W)
    return out


def quantize_rows(rows: torch.Tensor, group: int, scales_column_major: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / group)]): one scale per row and group of `group`
    inputs (group >= K: per row), amax / 448. `scales_column_major`: the scales laid out [groups, M] underneath
    (cuBLAS's block-scaled GEMM reads them so)."""
    m, k = rows.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=rows.device)
    if scales_column_major:
        scales = torch.empty(groups, m, dtype=torch.float32, device=rows.device).t()
    else:
        scales = torch.empty(m, groups, dtype=torch.float32, device=rows.device)
    _quantize_rows_kernel[(m, groups)](rows, q, scales, k, min(group, k), rows.stride(0), q.stride(0),
                                       scales.stride(0), scales.stride(1), BLOCK=_QUANT_BLOCK)
    return q, scales


def dense_linear(rows: torch.Tensor, layer) -> torch.Tensor:
    """rows [M, K] (bf16 / fp16, CUDA; act-order columns already gathered) through `layer` -> [M, N]."""
    bias = layer.bias.to(rows.dtype) if layer.bias is not None else None
    if layer.format == "fp8" and rows.dtype == torch.bfloat16:
        if rowwise_takes(layer, rows.device):
            q, scales = quantize_rows(rows, layer.in_features)
            return torch._scaled_mm(q, layer.weight.t(), scale_a=scales, scale_b=layer.weight_scale.view(1, -1),
                                    out_dtype=torch.bfloat16, bias=bias)
        if blockwise_takes(layer, rows.device):
            out = blockwise_mm(rows, layer.weight, layer.weight_scale_blocks)
            return out + bias if bias is not None else out
    return F.linear(rows, dequantize(layer, rows.dtype), bias)


def rowwise_takes(layer, device: torch.device) -> bool:
    """Per-channel FP8 on a Hopper-class device, sizes multiples of 16: torch._scaled_mm with row-wise scales."""
    return (layer.block_n == 1 and layer.block_k >= layer.in_features and layer.in_features % 16 == 0
            and layer.out_features % 16 == 0 and _capability(device) >= (9, 0))


def blockwise_takes(layer, device: torch.device) -> bool:
    """Qwen's 128x128 blocks, whole blocks, where cuBLAS's block-scaled FP8 GEMM ran right on `device`."""
    return ((layer.block_n, layer.block_k) == (128, 128) and layer.in_features % 128 == 0
            and layer.out_features % 128 == 0 and blockwise_works(device))


def blockwise_mm(rows: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = rows quantized per (row, 128 inputs) times an e4m3 weight [N, K] in 128x128 blocks."""
    from torch.nn.functional import ScalingType

    q, scales = quantize_rows(rows, 128, scales_column_major=True)
    return F.scaled_mm(q, weight.t(), scales, ScalingType.BlockWise1x128, weight_scales, ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)


_blockwise: dict[torch.device, bool] = {}


def blockwise_works(device: torch.device) -> bool:
    """Whether the block-scaled FP8 GEMM runs on `device` and agrees with the dequantized product (CUDA 12.9 and
    Hopper); tried once per device, by `prepare` before any graph capture."""
    if device.type != "cuda" or _capability(device) < (9, 0):
        return False
    if device not in _blockwise:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the block-scaled FP8 GEMM is tried before any CUDA graph capture "
                               "(engine.model.quant.kernels.prepare)")
        _blockwise[device] = _try_blockwise(device)
    return _blockwise[device]


def _try_blockwise(device: torch.device) -> bool:
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(256, 384, device=device, generator=gen)
        x = torch.randn(48, 384, device=device, generator=gen).to(torch.bfloat16)
        blocks = w.view(2, 128, 3, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        wq = (blocks / scale[:, None, :, None]).view(256, 384).to(torch.float8_e4m3fn)
        got = blockwise_mm(x, wq, blockwise_scales(scale)).float()
        ref = x.float() @ (wq.float().view(2, 128, 3, 128) * scale[:, None, :, None]).view(256, 384).t()
        return bool((got - ref).abs().max() <= 0.05 * ref.abs().max())
    except (RuntimeError, NotImplementedError, ImportError, TypeError, ValueError):
        return False


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


@functools.lru_cache(maxsize=None)
def _native_fp8(device: torch.device) -> bool:
    return device.type != "cuda" or _capability(device) >= (8, 9)
