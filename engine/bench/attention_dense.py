"""A prompt chunk's attention over contiguous keys: the dense flash-attention forward that the paged prefill kernel
is measured against, for `bench attention --rows prefill --backends dense,gather_dense`.

The paged kernel (engine.model.attention.triton_prefill) finds every key's pool block through the block table, so
each key tile costs a table load and a per-row address. This kernel reads keys and values laid out one after the
other per KV head, [Hkv, S, D]: a tile's addresses are one scalar base plus offsets fixed for the whole loop. Its
rate against the paged kernel's, at the same shapes in the same run, says what the paging costs and what a Triton
flash kernel reaches on the device at all (the 176K first token's goal needs ~1.2x the paged kernel's rate:
docs/BENCHMARKS.md). Comparison only: the engine does not use it.

One program per (query head, tile of the chunk's queries); the chunk's queries sit at positions [start, start + T)
and see the keys up to their own position (causal, aligned to the bottom right of the key span S = start + T).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _dense_tile(q, m_i, l_i, acc, k_base, v_base, offs, key0, pos, n, span, qk_scale, stride_kt,
                MASKED: tl.constexpr):
    """One tile of keys [key0, key0 + BLOCK_N) into the running (max, sum, accumulator)."""
    if MASKED:
        in_span = (key0 + n) < span
        k = tl.load(k_base + key0 * stride_kt + offs, mask=in_span[:, None], other=0.0)
        v = tl.load(v_base + key0 * stride_kt + offs, mask=in_span[:, None], other=0.0)
    else:
        k = tl.load(k_base + key0 * stride_kt + offs)
        v = tl.load(v_base + key0 * stride_kt + offs)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where((key0 + n)[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _dense_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, stride_qh, stride_qt, stride_kh, stride_kt,
                          stride_oh, stride_ot, start, T, qk_scale,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    qk_scale = tl.full([], qk_scale, tl.float32)
    head = tl.program_id(0)
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the last tiles see the most keys: start them first
    h = (head // G).to(tl.int64)
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qt + d[None, :], mask=row_ok[:, None], other=0.0)
    pos = tl.where(row_ok, start + rows, -1)
    span = start + T
    n = tl.arange(0, BLOCK_N)
    offs = n[:, None] * stride_kt + d[None, :]  # fixed for the loop: only the scalar base moves
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_kh
    # keys below the tile's first position are seen by every row: no mask there
    full_end = (start + q_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(start + (q_tile + 1) * BLOCK_M, span)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for key0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _dense_tile(q, m_i, l_i, acc, k_base, v_base, offs, key0, pos, n, span, qk_scale,
                                    stride_kt, False)
    for key0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _dense_tile(q, m_i, l_i, acc, k_base, v_base, offs, key0, pos, n, span, qk_scale,
                                    stride_kt, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = head * stride_oh + rows[:, None] * stride_ot + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def dense_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, block_m: int = 128,
                            block_n: int = 64, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """q [1, Hq, T, D] at positions [start, start + T) over k, v [1, Hkv, start + T, D] (contiguous per head)
    -> [1, Hq, T, D]."""
    _, hq, t, d = q.shape
    hkv = k.shape[1]
    assert k.shape[2] == start + t and k.stride(3) == 1 and v.stride() == k.stride() and q.stride(3) == 1
    if q.dtype == torch.float32:  # the interpreter's tests: exact dots take twice the registers
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    block_m = min(block_m, max(16, triton.next_power_of_2(t)))
    out = torch.empty_like(q)
    _dense_prefill_kernel[(hq, triton.cdiv(t, block_m))](
        q, k, v, out, q.stride(1), q.stride(2), k.stride(1), k.stride(2), out.stride(1), out.stride(2),
        start, t, _LOG2E / math.sqrt(d),
        G=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
    return out
