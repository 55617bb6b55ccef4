"""Paged prefill attention in Triton: a prompt chunk's queries over its slot's cached prefix and the chunk itself,
keys read in place through the block table (no gathered copy of the span).

    out = paged_prefill_attention(q, k_pool, v_pool, k_scale, v_scale, block_table, slots, positions,
                                  span_tokens, context_tokens)

Storage as in engine.model.attention.triton_paged (pools `[Hkv, num_blocks, block_tokens, D]`, int8 with float32
scales `[Hkv, num_blocks, block_tokens]`, a block table `[num_slots, blocks_per_slot]`). The chunk's keys and
values are already in the pool (SlotKVCache.attend writes them first), so prefix and chunk are one span.

Flash attention, one program per (query head, tile of the chunk's queries, batch row). The grid runs over query
heads, not KV heads with the group folded in (the decode kernel's choice): a prefill tile already has up to
BLOCK_M queries of one head, so each key tile is reused BLOCK_M times and the kernel is bound by the dots, not by
reading keys; folding the group in would only shrink the chunk's share of a tile, and a ratio like 40 / 8 would
pad it. The query head is the fastest grid axis, so the G heads that share a KV head run side by side and read
each key tile while it is still in L2.

Causal by position: query (b, t) at position p sees keys 0..p of its slot. A tile streams keys up to its largest
position (tiles wholly past it are never read) and applies no mask to the tiles every row of it sees wholly
(below its smallest position); the last query tiles, which read the most keys, are launched first. Rows at or
past `context_tokens` are padding (a chunk padded to its length bucket writes scratch columns there): they read
what their tile reads but store zeros. int8 keys and values are converted in registers: the key scale multiplies
the scores, the value scale multiplies P before P.V. fp32 runs with exact (IEEE) dots.

A tile's keys come through the block table key by key, from one block's base address when the tile lies inside
one pool block, or through TMA descriptors of the pools viewed as [rows, D] (PrefillConfig.loads): the per-key
addresses of the first cost registers and instructions in every tile of a 176K-token span.

A short chunk deep into a span is few programs each streaming the whole span: with PrefillConfig.split_programs
each program's key tiles are split so the launch has about that many programs; each split stores its normalized
part and log-sum-exp, and triton_paged's combine kernel (the decode kernel's) merges them.

Graph-capturable: the grid depends only on the batch, the heads and the chunk's length bucket; positions, lengths
and the block table are read on the device.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.model.attention.triton_paged import combine_splits, even_splits, pool_sources, scale_pools, tile_loads
from engine.model.attention.triton_paged_config import PrefillConfig, default_prefill_config


_LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e)), folded into the score scale
_LOG2E_JIT = tl.constexpr(_LOG2E)  # a split's log-sum-exp goes to the combine kernel in base e
_MIN_SPLIT_TILES = 8  # a split streams at least this many key tiles: fewer, and the combine's reads weigh more


@triton.jit
def _tile(q, m_i, l_i, acc, k_src, v_src, ks_ptr, vs_ptr, table_ptr, slot, h, tile, pos, kv_len, qk_scale,
          stride_kh, stride_kb, stride_sh, stride_sb, stride_tab, head_rows, d, d_ok,
          BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, INT8: tl.constexpr,
          PRECISION: tl.constexpr, MASKED: tl.constexpr, LOADS: tl.constexpr):
    """One key tile into the running (max, sum, accumulator). MASKED: the tile crosses some row's causal limit
    (or the span's end); otherwise every row of the tile sees every key of it. LOADS (see PrefillConfig.loads):
    0 each key finds its own pool block (a tile may span several), 1 the tile lies in one block (one table load,
    then one base address), 2 as 1 through TMA descriptors of the pools (k_src, v_src)."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_span = keys < kv_len
    if LOADS == 0:
        if MASKED:
            phys = tl.load(table_ptr + slot * stride_tab + keys // PAGE, mask=in_span, other=0).to(tl.int64)
            kv_mask = in_span[:, None] & d_ok[None, :]
        else:
            phys = tl.load(table_ptr + slot * stride_tab + keys // PAGE).to(tl.int64)
            kv_mask = d_ok[None, :]
        k_off = h * stride_kh + phys[:, None] * stride_kb + (keys % PAGE)[:, None] * D + d[None, :]
        k = tl.load(k_src + k_off, mask=kv_mask, other=0)
        v = tl.load(v_src + k_off, mask=kv_mask, other=0)
        scale_off = h * stride_sh + phys * stride_sb + keys % PAGE
    else:
        phys = tl.load(table_ptr + slot * stride_tab + (tile * BLOCK_N) // PAGE).to(tl.int64)
        in_block = (tile * BLOCK_N) % PAGE + tl.arange(0, BLOCK_N)
        if LOADS == 1:
            k_off = h * stride_kh + phys * stride_kb + in_block[:, None] * D + d[None, :]
            if MASKED:
                kv_mask = in_span[:, None] & d_ok[None, :]
                k = tl.load(k_src + k_off, mask=kv_mask, other=0)
                v = tl.load(v_src + k_off, mask=kv_mask, other=0)
            else:
                k = tl.load(k_src + k_off)
                v = tl.load(v_src + k_off)
        else:
            row = ((h * head_rows + phys) * PAGE + (tile * BLOCK_N) % PAGE).to(tl.int32)
            k = k_src.load([row, 0])
            v = v_src.load([row, 0])
            if MASKED:  # past the span's end a block holds whatever it held (a NaN would poison P.V)
                k = tl.where(in_span[:, None], k, 0)
                v = tl.where(in_span[:, None], v, 0)
        scale_off = h * stride_sh + phys * stride_sb + in_block
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if INT8:
        # Scales are read unmasked: every tile lies in blocks of the span. The arithmetic is the one measured
        # fastest for int8 (a separate rescale and add after P.V; the bf16 path's folded forms ran slower here).
        s = s * tl.load(ks_ptr + scale_off)[None, :] * qk_scale
        if MASKED:
            s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new  # a row that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:  # a key past the span reads another block's scale (block 0, or past the row's end): 0 * NaN
            p = p * tl.load(vs_ptr + scale_off, mask=in_span, other=0.0)[None, :]
        else:
            p = p * tl.load(vs_ptr + scale_off)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    else:
        if MASKED:
            s = tl.where(keys[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
        else:  # the scale folded into the subtraction: one multiply-add per score
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_safe = m_new
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P.V accumulates into the rescaled accumulator inside the dot (no separate add over the whole tile)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_src, v_src, ks_ptr, vs_ptr, table_ptr, slots_ptr, pos_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh, stride_qt,
    stride_kh, stride_kb,
    stride_sh, stride_sb,
    stride_tab,
    stride_ob, stride_oh, stride_ot,
    qk_scale, span_tokens, context_tokens, T, head_rows, split_tiles,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr, LOADS: tl.constexpr, SPLITS: tl.constexpr,
):
    # torch.compile (inductor) passes a Python float as fp64: the scores, and so the loop-carried max, would turn
    # fp64 and the kernel fail to compile, which turns COMPILE off.
    qk_scale = tl.full([], qk_scale, tl.float32)
    head = tl.program_id(0)
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the last tiles see the most keys: start them first
    b = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS  # SPLITS > 1: this program's share of the key tiles (split_tiles each)
    h = (head // G).to(tl.int64)  # h * (a KV head's pool stride) can pass 2**31 elements
    t = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = t < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + head * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1).to(tl.int32)
    pos = tl.where(pos < context_tokens, pos, -1)  # padding rows see no key
    real = pos >= 0
    kv_len = tl.minimum(tl.max(pos, axis=0) + 1, span_tokens)
    # Keys below `seen_by_all` are visible to every real row of the tile: those tiles need no mask.
    seen_by_all = tl.minimum(tl.min(tl.where(real, pos, span_tokens), axis=0) + 1, kv_len)
    full_tiles = tl.maximum(seen_by_all, 0) // BLOCK_N
    last_tile = tl.cdiv(kv_len, BLOCK_N)
    slot = tl.load(slots_ptr + b)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first, end = 0, last_tile
    if SPLITS > 1:
        first = split * split_tiles
        end = tl.minimum(first + split_tiles, last_tile)
    for tile in range(first, tl.minimum(full_tiles, end)):
        m_i, l_i, acc = _tile(q, m_i, l_i, acc, k_src, v_src, ks_ptr, vs_ptr, table_ptr, slot, h, tile, pos, kv_len,
                              qk_scale, stride_kh, stride_kb, stride_sh, stride_sb, stride_tab, head_rows, d, d_ok,
                              BLOCK_N, D, PAGE, INT8, PRECISION, False, LOADS)
    for tile in range(tl.maximum(full_tiles, first), end):
        m_i, l_i, acc = _tile(q, m_i, l_i, acc, k_src, v_src, ks_ptr, vs_ptr, table_ptr, slot, h, tile, pos, kv_len,
                              qk_scale, stride_kh, stride_kb, stride_sh, stride_sb, stride_tab, head_rows, d, d_ok,
                              BLOCK_N, D, PAGE, INT8, PRECISION, True, LOADS)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = tl.where(real[:, None], out, 0.0)
    if SPLITS > 1:  # each split's normalized part and its log-sum-exp (the running max is in base 2: converted
        # to base e), rows laid out as the decode kernel's splits ((KV head, split), then query row g * T + t) for
        # triton_paged's combine kernel
        lse = tl.where(real & (l_i > 0), (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) / _LOG2E_JIT, float("-inf"))
        base = ((b * (tl.num_programs(0) // G) + h) * SPLITS + split) * (G * T) + (head % G) * T
        tl.store(mid_lse_ptr + base + t, lse, mask=row_ok)
        tl.store(mid_o_ptr + (base + t[:, None]) * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
    else:
        o_off = b * stride_ob + head * stride_oh + t[:, None] * stride_ot + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch_shape(dtype: torch.dtype, chunk_tokens: int, config: PrefillConfig) -> tuple[int, int, int, int]:
    """(query rows, keys per tile, warps, stages) of one launch. fp32 halves the tiles: its exact dots take twice
    the registers and shared memory of bf16's."""
    block_m, block_n, stages = config.query_tokens, config.tile_tokens, config.num_stages
    if dtype == torch.float32:
        block_m, block_n, stages = min(block_m, 64), min(block_n, 32), min(stages, 2)
    block_m = min(block_m, max(16, triton.next_power_of_2(chunk_tokens)))  # a short chunk: no idle rows
    return block_m, block_n, config.num_warps, stages


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_table: torch.Tensor,
                            slots: torch.Tensor, positions: torch.Tensor, span_tokens: int, context_tokens: int,
                            config: PrefillConfig | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] (bf16/fp16, or fp32 with exact fp32 dots), positions [B, T] long -> [B, Hq, T, D]."""
    b, hq, t, d = q.shape
    hkv, head_blocks, block_tokens, _ = k_pool.shape
    g = hq // hkv
    assert hq == g * hkv, (hq, hkv)
    assert positions.shape == (b, t), (positions.shape, q.shape)
    assert q.stride(3) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous(), "contiguous head dim expected"
    int8, ks, vs = scale_pools(k_pool, v_pool, k_scale, v_scale)
    config = config or default_prefill_config(int8)
    block_m, block_n, warps, stages = launch_shape(q.dtype, t, config)
    block_d = max(16, triton.next_power_of_2(d))
    loads = tile_loads(config.loads if block_d == d else "gather", block_n, block_tokens, k_pool,
                       q.is_cuda and q.dtype == torch.float32)
    k_src, v_src = pool_sources(k_pool, v_pool, loads, block_n)
    # [B, Hq, T, D] over [B, T, Hq, D] memory: the layer's `out.transpose(1, 2).reshape(B, T, Hq * D)` is then a
    # view, not a copy of every multi-token forward's output (a verify's, a chunk's)
    out = q.new_empty(b, t, hq, d).transpose(1, 2)
    positions, slots = positions.contiguous(), slots.contiguous()
    q_tiles = triton.cdiv(t, block_m)
    splits, split_tiles = prefill_split_plan(b * hq * q_tiles, span_tokens, block_n, config.split_programs)
    mid_o = mid_lse = out  # never written without splits
    if splits > 1:
        mid_o = torch.empty(b, hkv, splits, g * t, block_d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(b, hkv, splits, g * t, dtype=torch.float32, device=q.device)
    _paged_prefill_kernel[(hq, q_tiles, b * splits)](
        q, k_src, v_src, ks, vs, block_table, slots, positions, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0,
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        _LOG2E / math.sqrt(d), span_tokens, context_tokens, t, head_blocks, split_tiles,
        G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=block_tokens,
        INT8=int8, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", LOADS=loads, SPLITS=splits,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        combine_splits(mid_o, mid_lse, out, splits, t, g)
    return out


def prefill_split_plan(programs: int, span_tokens: int, tile_tokens: int, split_programs: int) -> tuple[int, int]:
    """(splits, key tiles per split) of a launch of `programs` (row, query head, query tile) programs: with
    `split_programs` (PrefillConfig) and fewer programs than that, each program's keys are split so the launch
    has about that many, each split streaming at least _MIN_SPLIT_TILES tiles; else (1, 0). A short chunk deep
    into a span (a reused prompt's tail, a new turn of a long conversation) is a few programs each streaming the
    whole span: most SMs idle. Static shapes only, so a captured graph keeps the plan."""
    tiles = -(-span_tokens // tile_tokens)
    if split_programs <= programs or tiles < 2 * _MIN_SPLIT_TILES:
        return 1, 0
    return even_splits(tiles, -(-split_programs // programs), _MIN_SPLIT_TILES)
