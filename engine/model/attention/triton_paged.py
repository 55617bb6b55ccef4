"""Paged decode / verify attention in Triton: few queries per sequence, keys read in place through a block table.

    out = paged_decode_attention(q, k_pool, v_pool, k_scale, v_scale, block_table, slots, positions,
                                 span_tokens, context_tokens)

Storage (engine.exec.kv.cache): per layer a pool `[Hkv, num_blocks, block_tokens, D]` (bf16, or int8 with
float32 scales `[Hkv, num_blocks, block_tokens]`, one per token and head) and a block table
`[num_slots, blocks_per_slot]` (int32) that maps a slot's logical block to a physical block of the pool.

One program per (batch row, KV head, split): the row's T queries times the head's G query heads are packed into
the rows of one tile (GQA of any ratio; keys are read once per KV head). Each split streams its share of the
keys with an online softmax; a second kernel combines the splits (flash-decoding). int8 keys and values are
converted in registers: the key scale multiplies the scores, the value scale multiplies P before P.V.

Graph-capturable: the grid depends only on the batch and the static span; lengths (positions) and the block
table are read on the device, and each row splits its own keys by its length, so a span of the whole context
serves every length (the runner's steps on this path are keyed by batch alone: ModelRunner.step_span). Rows
whose positions are at or past `context_tokens` are padding (scratch columns): they read nothing and produce
zeros. Query row (g, t) of KV head h is query head h*G + g at token t and sees keys 0..positions[b, t] (the
reference path's causal-by-position rule).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.model.attention.triton_paged_config import DEFAULT_CONFIG, TILE_LOADS, KernelConfig
from engine.model.pdl import gdc_start, launch_kwargs

try:  # host-side TMA descriptors (Triton 3.4 and later); without them a config's "tma" loads run as "block"
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton
    TensorDescriptor = None

_TARGET_PROGRAMS = 264  # ~2 per SM on an H100/H200 (132 SMs): enough splits to fill the device


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, slots_ptr, pos_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh, stride_qt,
    stride_kh, stride_kb,
    stride_sh, stride_sb,
    stride_tab,
    stride_ob, stride_oh, stride_ot,
    sm_scale, span_tokens, context_tokens, min_split_tiles, num_splits, head_rows,
    T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SINGLE: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr,
    LOADS: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_start(USE_GDC)
    sm_scale = tl.full([], sm_scale, tl.float32)  # torch.compile passes a Python float as fp64 (see triton_prefill.py)
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    g = rows // T
    t = rows % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    head = h * G + g
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1).to(tl.int32)
    pos = tl.where(pos < context_tokens, pos, -1)  # padding rows see no key
    kv_len = tl.minimum(tl.max(pos, axis=0) + 1, span_tokens)
    slot = tl.load(slots_ptr + b)
    # in 64 bits: a pool that holds the prefix-cache tier's blocks (SHARED_PREFIX) can pass 2**31 elements, and
    # h * its head stride with it (in 32 bits: an illegal memory access with int8 KV on a full card)
    h_pool = h.to(tl.int64) * stride_kh
    # This row's own keys in even splits of at least min_split_tiles tiles (even_splits, on the device): the grid
    # has the splits of the static span, a row uses as many as its length fills, so one graph serves every length
    tiles = tl.cdiv(kv_len, BLOCK_N)
    used_splits = tl.maximum(1, tl.minimum(num_splits, tiles // min_split_tiles))
    split_tiles = tl.cdiv(tiles, used_splits)
    first_tile = split * split_tiles
    last_tile = tl.minimum(first_tile + split_tiles, tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(first_tile, last_tile):
        keys = tile * BLOCK_N + n
        # Values past the row's length are loaded as zeros, never read: their scores are masked out below (a NaN
        # key's score too: `where` replaces it), but P.V would still multiply what the values hold by 0, and
        # 0 * NaN is NaN. They live in block 0 (LOADS 0: the table entry is not read) or past the row's end in its
        # own block, where another slot's NaN or a request that ended on NaN logits may have left it.
        in_len = keys < kv_len
        v_ok = in_len[:, None] & d_ok[None, :]
        if LOADS == 0:
            # A tile of BLOCK_N keys may span several pool blocks (or part of one): each key finds its own block.
            phys = tl.load(table_ptr + slot * stride_tab + keys // PAGE, mask=in_len, other=0).to(tl.int64)
            k_off = h_pool + phys[:, None] * stride_kb + (keys % PAGE)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + k_off, mask=d_ok[None, :], other=0)
            v = tl.load(v_ptr + k_off, mask=v_ok, other=0)
            scale_off = h * stride_sh + phys * stride_sb + keys % PAGE
        else:
            # The tile lies inside one pool block: one table entry.
            phys = tl.load(table_ptr + slot * stride_tab + (tile * BLOCK_N) // PAGE).to(tl.int64)
            in_block = (tile * BLOCK_N) % PAGE + n
            if LOADS == 1:
                k_off = h_pool + phys * stride_kb + in_block[:, None] * D + d[None, :]
                k = tl.load(k_ptr + k_off, mask=d_ok[None, :], other=0)
                v = tl.load(v_ptr + k_off, mask=v_ok, other=0)
            else:
                row = ((h * head_rows + phys) * PAGE + (tile * BLOCK_N) % PAGE).to(tl.int32)
                k = k_ptr.load([row, 0])
                v = tl.where(in_len[:, None], v_ptr.load([row, 0]), 0)
            scale_off = h * stride_sh + phys * stride_sb + in_block
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if INT8:
            ks = tl.load(ks_ptr + scale_off)
            s = s * ks[None, :]
        s = s * sm_scale
        visible = keys[None, :] <= pos[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if INT8:
            vs = tl.load(vs_ptr + scale_off, mask=in_len, other=0.0)
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    if SINGLE:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = b * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        base = (b * tl.num_programs(1) + h) * num_splits + split
        tl.store(mid_lse_ptr + base * BLOCK_M + rows, lse)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        # a split past the row's keys leaves its part unwritten: the combine reads a part only where lse is finite
        tl.store(mid_o_ptr + (base * BLOCK_M + rows[:, None]) * BLOCK_D + d[None, :], o,
                 mask=first_tile + tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.int32) < last_tile)


@triton.jit
def _combine_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, stride_ot, num_splits,
    T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_start(USE_GDC)
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)  # one query row (g, t) of this KV head
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    base = (b * tl.num_programs(1) + h) * num_splits + s  # [BLOCK_S]
    lse = tl.load(mid_lse_ptr + base * BLOCK_M + r, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # splits that saw no key weigh 0
    seen = s_ok & (lse > float("-inf"))  # a split that saw no key may not have written its part
    o = tl.load(mid_o_ptr + (base[:, None] * BLOCK_M + r) * BLOCK_D + d[None, :], mask=seen[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    g = r // T
    t = r % T
    o_off = b * stride_ob + (h * G + g) * stride_oh + t * stride_ot + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < D)




def scale_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(int8?, key scales, value scales) for a kernel launch: an int8 pool needs its scales; a bf16 one passes
    the pool itself in their place (Triton wants a tensor argument; the kernel never reads it). The kernels
    address the values with the keys' strides (and the value scales with the key scales'): pools of different
    shapes are a ValueError here, not a read past the smaller tensor's end."""
    int8 = k_pool.dtype == torch.int8
    if v_pool.shape != k_pool.shape or (int8 and (k_scale is None or v_scale is None
                                                  or v_scale.shape != k_scale.shape)):
        raise ValueError(f"a layer's KV pools differ: keys {tuple(k_pool.shape)}, values {tuple(v_pool.shape)}"
                         + (f", scales {None if k_scale is None else tuple(k_scale.shape)} / "
                            f"{None if v_scale is None else tuple(v_scale.shape)}" if int8 else ""))
    if not int8:
        return False, k_pool, k_pool
    return True, k_scale, v_scale


def tile_loads(requested: str, tile_tokens: int, block_tokens: int, pool: torch.Tensor, exact: bool) -> int:
    """The kernels' LOADS for a launch (KernelConfig.loads, PrefillConfig.loads: 0 gather, 1 block, 2 tma): a tile
    inside one pool block ("block", "tma") needs keys per tile dividing the block's; "tma" a pool whose rows a
    32-bit coordinate reaches, Triton's host descriptors, and a serving dtype (`exact`: fp32 on the GPU, the
    tests' oracle path, keeps plain loads: TMA's box limits are for 1- and 2-byte elements). Inside a
    torch.compile trace (COMPILE) "tma" runs as "block": Dynamo's handling of a host descriptor argument to a
    user kernel has not run on a GPU here, and a failed compile would degrade the switch."""
    loads = TILE_LOADS.index(requested)
    if block_tokens % tile_tokens:
        return 0
    if loads == 2 and (TensorDescriptor is None or exact or pool.numel() // pool.shape[-1] >= 2**31
                       or torch.compiler.is_compiling()):
        return 1
    return loads


def pool_sources(k_pool: torch.Tensor, v_pool: torch.Tensor, loads: int, tile_tokens: int) -> tuple:
    """What the kernels read keys and values from: the pools, or (LOADS 2) TMA descriptors of them as [rows, D]
    whose box is one tile."""
    if loads != 2:
        return k_pool, v_pool
    d = k_pool.shape[-1]
    return tuple(TensorDescriptor.from_tensor(pool.view(-1, d), [tile_tokens, d]) for pool in (k_pool, v_pool))


def split_plan(batch: int, num_kv_heads: int, span_tokens: int, tile_tokens: int,
               min_split_tiles: int = DEFAULT_CONFIG.min_split_tiles) -> tuple[int, int]:
    """(splits, tiles per split) for a static span: enough programs to fill the device, each streaming at
    least `min_split_tiles` tiles. Depends only on static shapes, so a captured graph keeps it."""
    return even_splits(-(-span_tokens // tile_tokens), -(-_TARGET_PROGRAMS // (batch * num_kv_heads)),
                       min_split_tiles)


def even_splits(tiles: int, want: int, min_split_tiles: int) -> tuple[int, int]:
    """(splits, tiles per split): `tiles` key tiles in up to `want` splits of at least `min_split_tiles` each,
    as even as whole tiles allow (the decode kernel's and the prefill kernel's split keys)."""
    splits = max(1, min(want, tiles // min_split_tiles))
    per_split = -(-tiles // splits)
    return -(-tiles // per_split), per_split


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_table: torch.Tensor,
                           slots: torch.Tensor, positions: torch.Tensor, span_tokens: int, context_tokens: int,
                           config: KernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """q [B, Hq, T, D] (bf16/fp16, or fp32 with exact fp32 dots), positions [B, T] long -> [B, Hq, T, D]."""
    b, hq, t, d = q.shape
    hkv, _, block_tokens, _ = k_pool.shape
    g = hq // hkv
    assert hq == g * hkv and t * g <= 128, (hq, hkv, t)
    assert q.stride(3) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous(), "contiguous head dim expected"
    block_m = max(16, triton.next_power_of_2(g * t))
    block_d = max(16, triton.next_power_of_2(d))
    tile = config.tile_tokens
    assert tile % block_tokens == 0 or block_tokens % tile == 0, (tile, block_tokens)
    splits, _ = split_plan(b, hkv, span_tokens, tile, config.min_split_tiles)
    # [B, Hq, T, D] over [B, T, Hq, D] memory: the layer's `out.transpose(1, 2).reshape(B, T, Hq * D)` is then a
    # view, not a copy of every multi-token forward's output (a verify's, a chunk's)
    out = q.new_empty(b, t, hq, d).transpose(1, 2)
    int8, ks, vs = scale_pools(k_pool, v_pool, k_scale, v_scale)
    loads = tile_loads(config.loads if block_d == d else "gather", tile, block_tokens, k_pool,
                       q.is_cuda and q.dtype == torch.float32)
    k_src, v_src = pool_sources(k_pool, v_pool, loads, tile)
    if splits > 1:
        mid_o = torch.empty(b, hkv, splits, block_m, block_d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(b, hkv, splits, block_m, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # never written
    positions, slots = positions.contiguous(), slots.contiguous()  # verify's inputs are strided views
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_src, v_src, ks, vs, block_table, slots, positions, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0,
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        1.0 / math.sqrt(d), span_tokens, context_tokens, config.min_split_tiles, splits, k_pool.shape[1],
        T=t, G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=tile, PAGE=block_tokens, SINGLE=splits == 1,
        INT8=int8, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", LOADS=loads,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_kwargs(),
    )
    if splits > 1:
        combine_splits(mid_o, mid_lse, out, splits, t, g)
    return out


def combine_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, splits: int, t: int,
                   g: int) -> None:
    """out [B, Hq, T, D] from the splits' parts mid_o [B, Hkv, splits, rows, BLOCK_D] and their log-sum-exps
    mid_lse [B, Hkv, splits, rows] (row g * T + t is query head h * G + g at token t; rows >= G * T, the decode
    kernel's padded tile, are never read)."""
    b, hkv, _, rows, block_d = mid_o.shape
    _combine_splits_kernel[(b, hkv, g * t)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), out.stride(2), splits,
        T=t, G=g, D=out.shape[-1], BLOCK_D=block_d, BLOCK_M=rows, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        num_warps=4, **launch_kwargs(),
    )
