"""An int4 kernel for the tensor-core path's rows (5-256) that unpacks two codes at a time and takes the weight as
the dot's first operand: the path's launch shapes ending in `xpairs` (engine.model.quant.kernels.QuantConfig).

At 16 rows the tensor-core kernel (engine.model.quant.tensor_core) is bound by its instructions, not by the bytes
it reads: each code is shifted, masked, made an fp32 and rounded to the dot's dtype on its own. Here one shift, one
mask and one or turn two codes of a word into two bf16 values at once: `(word >> 4j) & 0x000F000F | 0x43004300` is
the bf16 pair (128 + code j, 128 + code j + 4), exact (bf16 holds every whole number to 256). The step's product
with the codes shifted by 128 is then `dot(u + 128, x) = dot(u, x) + 128 * sum(x)`, so the shift is folded into the
step's offset (`offset - 128 * scale`), applied once a step as the tensor-core kernel applies its offset.

The weight tile is the dot's first operand and the rows its second (the output computed transposed, [BLOCK_N,
BLOCK_M]): the unpacked codes can reach the tensor cores from the registers they were computed in, where as the
second operand they are rearranged through shared memory first. The two codes of a pair are inputs `RUN * 4` apart; the activations are
loaded in the same order, so the dot pairs each code with its input (a dot's sum is over K in any order).

Takes int4 codes whose groups span a step (group 128 and up: one scale and offset per column a step), as a
launch-table entry or `bench linear --quant-tune` names it; split K and the ordered finish are the tensor-core
kernel's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.model.quant.tensor_core import finish, program_tile, step_words


@triton.jit
def int4_pairs_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, KW, kw_per_split,
                      stride_xm, stride_qn, stride_sn, stride_om,
                      GROUP: tl.constexpr, RUN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    CPW: tl.constexpr = 8
    split, rm, rn, m_ok, n_ok, rn64, q_rows = program_tile(q_ptr, stride_qn, M, N, BLOCK_M, BLOCK_N)
    x_cols = x_ptr + rm[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # the output transposed: columns by rows
    w_start = split * kw_per_split
    for w0 in range(w_start, w_start + kw_per_split, BLOCK_KW):
        _, w_ok, words, base = step_words(q_rows, n_ok, w0, KW, RUN, CPW, BLOCK_KW, EVEN_K)
        step = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_KW, BLOCK_M], dtype=tl.float32)  # summed over the slots, reduced once a step
        for j in tl.static_range(CPW // 2):
            pair = ((words >> (4 * j)) & 0x000F000F) | 0x43004300
            lo = (pair & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 128 + code j
            hi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 128 + code j + 4
            u = tl.join(lo, hi).reshape(BLOCK_N, 2 * BLOCK_KW)
            k_lo = base + RUN * j
            k_hi = k_lo + RUN * (CPW // 2)
            k = tl.join(k_lo, k_hi).reshape(2 * BLOCK_KW)
            k_ok = tl.join(w_ok & ((k_lo < K) | EVEN_K), w_ok & ((k_hi < K) | EVEN_K)).reshape(2 * BLOCK_KW)
            x = tl.load(x_cols + k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)  # [2 * BLOCK_KW, rows]
            step = tl.dot(u.to(x.dtype), x, step)  # (bf16 activations: no conversion)
            x_sum += tl.sum(x.to(tl.float32).reshape(BLOCK_KW, 2, BLOCK_M), axis=1)
        g = (tl.minimum(w0, KW - 1) * CPW) // GROUP  # a split's last step may lie past K (an empty product)
        s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32) - 128.0 * s
        # two explicit fmas, as the tensor-core kernel's: one rounding each, whatever the compiler fuses
        acc = tl.fma(step, s[:, None], tl.fma(tl.sum(x_sum, axis=0)[None, :], o[:, None], acc))
    finish(tl.trans(acc), b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om, SPLIT,
           HAS_BIAS)
