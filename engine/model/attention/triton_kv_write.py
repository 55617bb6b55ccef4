"""The FUSED_OPS KV write: one step's keys and values into the paged pool of one layer, in one Triton kernel.

    write_kv(k_pool, v_pool, k_scale, v_scale, k, v, blocks, offsets)

The reference (engine.exec.kv.cache.SlotKVCache._write) is two index_put kernels in bf16 and, for int8 KV, about
twenty (absolute value, maximum, clamp, division, rounding and four index_puts) per layer and step, the bulk of
the int8 step's extra kernels (docs/BENCHMARKS.md). Here one program quantizes one (token, KV head) row of D
values with the reference's arithmetic on CUDA (scale = max|x| times fp32 1/127, as torch divides a CUDA tensor
by a Python scalar; the codes by IEEE division, rounded half to even) and stores it with its scale where the
block table put that token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.attention.triton_paged import scale_pools


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr, blocks_ptr, offsets_ptr,
                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     stride_ph, stride_pb, stride_sh, stride_sb, n_tokens,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)  # one (row, token)
    h = tl.program_id(1).to(tl.int64)  # h * the head stride can pass 2**31 (a pool holding the tier's blocks)
    b = bt // n_tokens
    t = bt % n_tokens
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    block = tl.load(blocks_ptr + bt).to(tl.int64)
    offset = tl.load(offsets_ptr + bt).to(tl.int64)
    k = tl.load(k_ptr + b * stride_kb + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0)
    dst = h * stride_ph + block * stride_pb + offset * D + d
    at = h * stride_sh + block * stride_sb + offset
    store_kv_row(k, kp_ptr, ks_ptr, dst, at, ok, INT8)
    store_kv_row(v, vp_ptr, vs_ptr, dst, at, ok, INT8)


@triton.jit
def store_kv_row(x, pool_ptr, scale_ptr, dst, at, ok, INT8: tl.constexpr):
    """One (token, KV head) row x of D values into its pool at `dst` (element offsets of its D values); int8: with
    its scale at `at`. Shared with the q/k norm + RoPE kernel that writes its keys itself (engine.model.triton_ops)."""
    if INT8:
        # torch.round's half-to-even: adding and subtracting 1.5 * 2**23 rounds an fp32 below 2**22 that way
        xf = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-8) * (1.0 / 127.0)
        q = tl.minimum(tl.maximum((tl.math.div_rn(xf, scale) + 12582912.0) - 12582912.0, -127.0), 127.0)
        tl.store(pool_ptr + dst, q.to(tl.int8), mask=ok)
        tl.store(scale_ptr + at, scale)
    else:
        tl.store(pool_ptr + dst, x.to(pool_ptr.dtype.element_ty), mask=ok)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
             k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """k, v [B, Hkv, T, D] (any strides with a contiguous D) into pools [Hkv, num_blocks, block_tokens, D] at
    (blocks, offsets) [B, T]; int8 pools with their float32 scales [Hkv, num_blocks, block_tokens]."""
    b, hkv, t, d = k.shape
    assert k.stride(3) == 1 and v.stride(3) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    int8, ks, vs = scale_pools(k_pool, v_pool, k_scale, v_scale)
    assert ks.stride() == vs.stride(), "key and value scales laid out alike"
    blocks, offsets = blocks.reshape(b * t).contiguous(), offsets.reshape(b * t).contiguous()
    _write_kv_kernel[(b * t, hkv)](
        k, v, k_pool, v_pool, ks, vs, blocks, offsets,
        k.stride(0), k.stride(2), k.stride(1), v.stride(0), v.stride(2), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0, t,
        D=d, BLOCK_D=triton.next_power_of_2(d), INT8=int8, num_warps=1,
    )


def launch_once(k_pool: torch.Tensor, k_scale: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
    """FUSED_OPS' start-up probe of this kernel (see triton_ops.launch_each_once): one token written into a scratch
    pool of one block with the dtype, head count and head size of `k_pool`, from keys of the compute `dtype`."""
    hkv, _, page, d = k_pool.shape
    pools = [torch.zeros(hkv, 1, page, d, dtype=k_pool.dtype, device=device) for _ in range(2)]
    scales = [torch.ones(hkv, 1, page, device=device) for _ in range(2)] if k_scale is not None else [None, None]
    kv = torch.zeros(1, hkv, 1, d, dtype=dtype, device=device)
    where = torch.zeros(1, 1, dtype=torch.long, device=device)
    write_kv(*pools, *scales, kv, kv, where, where)

