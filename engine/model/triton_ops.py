"""The FUSED_OPS kernels: a decoder layer's elementwise chains as one Triton kernel each (CUDA; the tests also run
them in Triton's interpreter on CPU tensors).

    normed, summed = add_rms_norm(x, residual, weight, eps)   # residual + x, then RMSNorm(.) * weight
    qk = qk_norm_rope(src, q_heads, q_weight, k_weight, cos, sin_rot, eps)  # [B, T, H, D] -> [B, H, T, D]
    out = silu_mul(gate, up)                                   # silu(gate) * up
    cos, sin_rot = rope_tables(positions, inv_freq, scaling, dtype)  # RotaryEmbedding's tables, one kernel
    y = linear(x, weight, bias)                                # F.linear; a narrow one in Triton (triton_linear)
    q = qk_norm_rope_kv(qkv, q_heads, q_weight, k_weight, cos, sin_rot, eps, site)  # and k, v into the KV pool

A batch-1 decode step is bound by its kernel count, not its bytes (docs/MODEL.md, "Why these kernels"):
in eager PyTorch the residual add and RMSNorm with its weight are three kernels, the q/k norm and the rotation
about seven, SiLU and the product two, a forward's rotary tables ten. Each kernel here computes in fp32 and rounds
to the storage dtype at the points where the PyTorch ops of engine.model.layers round (the sum, the normalised
value, the weight product, each RoPE product and their sum, SiLU and its product), so it gives the reference's
values up to the order of the fp32 sum of squares and the last bit of the reciprocal square root; the rotary
tables are the reference's bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.model.attention.kv_site import KVSite
from engine.model.attention.triton_kv_write import store_kv_row
from engine.model.attention.triton_paged import scale_pools
from engine.model.pdl import gdc_start, launch_kwargs
# the layers reach every FUSED_OPS kernel through here
from engine.model.triton_linear import COUNTER_LANES, MAX_ROWS, linear, split_counters


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res, stride_out, stride_sum,
                         n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    eps = tl.full([], eps, tl.float32)  # torch.compile passes a Python float as fp64 (see triton_prefill.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the residual sum, rounded
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_normalize(s), s) with s = x + residual (s = x without a residual): the pre-norm residual
    stream's add and the next norm in one pass. x, residual [..., H] with a contiguous last dim."""
    h = x.shape[-1]
    rows_x = x.reshape(-1, h)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    rows_res = residual.reshape(-1, h) if residual is not None else rows_x
    rows_sum = summed.view(-1, h) if residual is not None else rows_x
    rows_out = out.view(-1, h)
    assert rows_x.stride(1) == 1 and rows_res.stride(1) == 1, "contiguous hidden dim expected"
    block = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(rows_x.shape[0],)](
        rows_x, rows_res, weight, rows_out, rows_sum, rows_x.stride(0), rows_res.stride(0), rows_out.stride(0),
        rows_sum.stride(0), h, eps, HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
        **launch_kwargs(),
    )
    return out, summed


@triton.jit
def _qk_norm_rope_kernel(src_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr,
                         blocks_ptr, offsets_ptr, stride_sb, stride_st, stride_sh, stride_cb, stride_ct,
                         stride_ph, stride_pb, stride_sc_h, stride_sc_b, n_tokens, out_heads, q_heads, kv_heads, eps,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr,
                         INT8: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    # One program per (row, token) and q or k head. WRITE_KV (a serving forward): a k head's program stores its rotated
    # key, and the value of the same KV head, straight into the pool where the block table put the token (write_kv's
    # stores), so the keys make no round trip through memory and the write is no launch of its own; `out` then
    # holds q's heads only.
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = bt // n_tokens
    t = bt % n_tokens
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    token = src_ptr + b * stride_sb + t * stride_st
    y = _norm_rope_head(token + h * stride_sh, qw_ptr, kw_ptr, cos_ptr + b * stride_cb + t * stride_ct,
                        sin_ptr + b * stride_cb + t * stride_ct, h < q_heads, eps, d, ok, out_ptr.dtype.element_ty,
                        D, NORM)
    if h < out_heads:
        tl.store(out_ptr + ((b * out_heads + h) * n_tokens + t) * D + d, y, mask=ok)
    if WRITE_KV:
        if h >= q_heads:
            j = (h - q_heads).to(tl.int64)  # the KV head; j * the head stride can pass 2**31
            block = tl.load(blocks_ptr + bt).to(tl.int64)
            offset = tl.load(offsets_ptr + bt).to(tl.int64)
            dst = j * stride_ph + block * stride_pb + offset * D + d
            at = j * stride_sc_h + block * stride_sc_b + offset
            store_kv_row(y, kp_ptr, ks_ptr, dst, at, ok, INT8)
            v = tl.load(token + (q_heads + kv_heads + j) * stride_sh + d, mask=ok, other=0.0)
            store_kv_row(v, vp_ptr, vs_ptr, dst, at, ok, INT8)


@triton.jit
def _norm_rope_head(base, qw_ptr, kw_ptr, cos_row, sin_row, is_q, eps, d, ok, dt: tl.constexpr, D: tl.constexpr,
                    NORM: tl.constexpr):
    """One (token, head) row of q or k: Qwen3's per-head RMSNorm (NORM), then the rotation, rounded as the
    reference rounds each product and their sum."""
    eps = tl.full([], eps, tl.float32)
    rolled = (d + D // 2) % D  # rotate_half(x) = roll(x, D/2) with its sign folded into sin_rot
    x = tl.load(base + d, mask=ok, other=0.0)
    xr = tl.load(base + rolled, mask=ok, other=0.0)
    if NORM:  # Qwen3's per-head RMSNorm of q and k, before the rotation
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        w = tl.where(is_q, tl.load(qw_ptr + d, mask=ok, other=0.0), tl.load(kw_ptr + d, mask=ok, other=0.0))
        wr = tl.where(is_q, tl.load(qw_ptr + rolled, mask=ok, other=0.0), tl.load(kw_ptr + rolled, mask=ok, other=0.0))
        x = (w.to(tl.float32) * (xf * inv_rms).to(dt).to(tl.float32)).to(dt)
        xr = (wr.to(tl.float32) * (xr.to(tl.float32) * inv_rms).to(dt).to(tl.float32)).to(dt)
    c = tl.load(cos_row + d, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    r = (xr.to(tl.float32) * s).to(dt).to(tl.float32)
    return (a + r).to(dt)


def qk_norm_rope(src: torch.Tensor, q_heads: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos: torch.Tensor, sin_rot: torch.Tensor, eps: float) -> torch.Tensor:
    """src [B, T, H, D] (q heads then k heads; any strides with a contiguous D, e.g. a view of the fused qkv
    projection) -> [B, H, T, D] contiguous: per-head RMSNorm with q's or k's weight (None: no q/k norm), then
    RoPE with RotaryEmbedding's cos / sin_rot [B, T, D]: apply_rope(weight * rms_normalize(x)) of the reference."""
    b, t, h, d = src.shape
    out = torch.empty(b, h, t, d, dtype=src.dtype, device=src.device)
    _launch_qk_norm_rope(src, h, q_heads, 0, q_weight, k_weight, cos, sin_rot, eps, out, None)
    return out


def qk_norm_rope_kv(qkv: torch.Tensor, q_heads: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                    cos: torch.Tensor, sin_rot: torch.Tensor, eps: float, site: KVSite) -> torch.Tensor:
    """A serving forward's qk_norm_rope of q and k from the fused projection's output qkv [B, T, Hq + 2 Hkv, D]
    (contiguous D), with the rotated keys and the values written into `site`'s pools (write_kv's rows, int8
    quantized alike) instead of returned: -> q [B, Hq, T, D] contiguous."""
    b, t, heads, d = qkv.shape
    kv_heads = (heads - q_heads) // 2
    assert site.k_pool.shape[0] == kv_heads and site.k_pool.shape[3] == d, (tuple(site.k_pool.shape), kv_heads, d)
    out = torch.empty(b, q_heads, t, d, dtype=qkv.dtype, device=qkv.device)
    _launch_qk_norm_rope(qkv, q_heads + kv_heads, q_heads, kv_heads, q_weight, k_weight, cos, sin_rot, eps, out, site)
    return out


def _launch_qk_norm_rope(src: torch.Tensor, heads: int, q_heads: int, kv_heads: int, q_weight: torch.Tensor | None,
                         k_weight: torch.Tensor | None, cos: torch.Tensor, sin_rot: torch.Tensor, eps: float,
                         out: torch.Tensor, site: KVSite | None) -> None:
    """One program per (row, token) and each of the first `heads` heads of src; `out` [B, out heads, T, D]."""
    b, t, _, d = src.shape
    assert src.stride(3) == 1 and cos.stride(2) == 1 and cos.stride() == sin_rot.stride(), "contiguous D expected"
    norm = q_weight is not None
    block = triton.next_power_of_2(d)
    if site is not None:
        assert site.k_pool.is_contiguous() and site.v_pool.is_contiguous()
        int8, ks, vs = scale_pools(site.k_pool, site.v_pool, site.k_scale, site.v_scale)
        pools = (site.k_pool, site.v_pool, ks, vs, site.blocks.reshape(b * t).contiguous(),
                 site.offsets.reshape(b * t).contiguous())
        strides = (site.k_pool.stride(0), site.k_pool.stride(1), ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0)
    else:
        int8, pools, strides = False, (out,) * 6, (0, 0, 0, 0)
    _qk_norm_rope_kernel[(b * t, heads)](
        src, q_weight if norm else cos, k_weight if norm else cos, cos, sin_rot, out, *pools,
        src.stride(0), src.stride(1), src.stride(2), cos.stride(0), cos.stride(1), *strides, t, out.shape[1],
        q_heads, kv_heads, eps, D=d, BLOCK_D=block, NORM=norm, WRITE_KV=site is not None, INT8=int8,
        num_warps=1 if block <= 256 else 4, **launch_kwargs(),
    )


# CUDA's cosf / sinf (libdevice), which torch's cos and sin kernels call: the tables are the reference's bit for bit.
# Triton's interpreter (the CPU tests) has no libdevice; numpy's cos there.
_LIBDEVICE = not os.environ.get("TRITON_INTERPRET")


@triton.jit
def _rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, stride_pb, stride_pt, n_tokens, scaling,
                        HALF: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                        USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    scaling = tl.full([], scaling, tl.float32)  # as in _add_rms_norm_kernel: a Python float may come as fp64
    row = tl.program_id(0).to(tl.int64)  # one (row, token)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    position = tl.load(pos_ptr + (row // n_tokens) * stride_pb + (row % n_tokens) * stride_pt)
    freq = position.to(tl.float32) * tl.load(inv_ptr + i, mask=ok, other=0.0)
    if LIBDEVICE:
        c, s = libdevice.cos(freq), libdevice.sin(freq)
    else:
        c, s = tl.cos(freq), tl.sin(freq)
    dt = cos_ptr.dtype.element_ty
    c, s = (c * scaling).to(dt), (s * scaling).to(dt)
    base = row * 2 * HALF
    tl.store(cos_ptr + base + i, c, mask=ok)
    tl.store(cos_ptr + base + HALF + i, c, mask=ok)
    tl.store(sin_ptr + base + i, -s, mask=ok)  # rotate_half's sign, as RotaryEmbedding folds it in
    tl.store(sin_ptr + base + HALF + i, s, mask=ok)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding.forward's (cos, sin_rot) [B, T, D] for positions [B, T] (any strides) and fp32 inv_freq
    [D/2]: fp32 angles, their cos and sin scaled by `scaling`, rounded once to `dtype`, in one kernel."""
    b, t = positions.shape
    half = inv_freq.shape[0]
    cos = torch.empty(b, t, 2 * half, dtype=dtype, device=positions.device)
    sin_rot = torch.empty_like(cos)
    _rope_tables_kernel[(b * t,)](positions, inv_freq, cos, sin_rot, positions.stride(0), positions.stride(1), t,
                                  scaling, HALF=half,
                                  BLOCK=triton.next_power_of_2(half), LIBDEVICE=_LIBDEVICE, num_warps=1,
                                  **launch_kwargs())
    return cos, sin_rot


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, n_cols, BLOCK: tl.constexpr,
                     USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded as its own kernel rounds
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(dt), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] with a contiguous last dim (e.g. the two halves of the fused
    gate/up projection) -> [..., I] contiguous."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    assert g.stride(1) == 1 and u.stride(1) == 1, "contiguous last dim expected"
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](
        g, u, out, g.stride(0), u.stride(0), n, BLOCK=block, num_warps=4, **launch_kwargs(),
    )
    return out


def _warps(block: int) -> int:
    """Warps for a one-row reduction of `block` columns: ~256 columns a warp, 1 to 16."""
    return max(1, min(16, block // 256))


def launch_each_once(config, dtype: torch.dtype, device: torch.device) -> None:
    """Launch every kernel once on tiny tensors of this model's shapes (FUSED_OPS' start-up probe): what a kernel
    cannot do on this device (Triton cannot compile it, or its launch fails) raises here, at start, with its real
    message, instead of failing a request's forward."""
    like = {"dtype": dtype, "device": device}
    h, d, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
    x = torch.zeros(1, 1, h, **like)
    add_rms_norm(x, x, torch.ones(h, **like), eps)
    add_rms_norm(x, None, torch.ones(h, **like), eps)
    qk = torch.zeros(1, 1, config.num_attention_heads + config.num_key_value_heads, d, **like)
    norm = torch.ones(d, **like) if config.qk_norm else None
    angles = torch.zeros(1, 1, d, **like)
    qk_norm_rope(qk, config.num_attention_heads, norm, norm, angles, angles, eps)
    rope_tables(torch.zeros(1, 1, dtype=torch.long, device=device), torch.ones(d // 2, device=device), 1.0, dtype)
    gate = torch.zeros(1, 1, config.intermediate_size, **like)
    silu_mul(gate, gate)
    # the narrow projections the layers hand the skinny matmul (o, down), at one row and at the most rows it takes:
    # its smallest and largest row tiles (the largest needs the most shared memory, which a smaller GPU may lack)
    for rows in (1, MAX_ROWS):
        for k in (config.num_attention_heads * d, config.intermediate_size):
            linear(torch.zeros(rows, 1, k, **like), torch.zeros(h, k, **like))
    for lane in COUNTER_LANES:  # every lane's counters exist before any capture (split_counters)
        split_counters(device, lane)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an asynchronous launch failure surfaces here, at start


def launch_rope_kv_once(config, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype) -> None:
    """The start-up probe (as launch_each_once) of the q/k norm + RoPE kernel writing into a scratch pool of the
    serving KV's dtype (int8 with its scales): made with the cache's write kernel (SlotKVCache.use_write_kernel)."""
    like = {"dtype": dtype, "device": device}
    d, eps = config.head_dim, config.rms_norm_eps
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    pools = [torch.zeros(hkv, 1, 1, d, dtype=kv_dtype, device=device) for _ in range(2)]
    scales = [torch.ones(hkv, 1, 1, device=device) for _ in range(2)] if kv_dtype == torch.int8 else [None, None]
    where = torch.zeros(1, 1, dtype=torch.long, device=device)
    norm = torch.ones(d, **like) if config.qk_norm else None
    angles = torch.zeros(1, 1, d, **like)
    qk_norm_rope_kv(torch.zeros(1, 1, hq + 2 * hkv, d, **like), hq, norm, norm, angles, angles, eps,
                    KVSite(*pools, *scales, where, where))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
