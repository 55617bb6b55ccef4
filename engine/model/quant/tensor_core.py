"""The 5-256 row path of the quantized kernels: tensor-core dots on weights expanded in registers.

Each program owns BLOCK_N output columns and one of SPLIT slices of K, walked in BLOCK_K steps; the rows of a
step are one [BLOCK_M, BLOCK_K] tile (BLOCK_M a power of two from 16, so up to 64 rows read the weight once),
and the launch shape follows the weight's shape only, so a row's output does not depend on the other rows of a
step of up to 16 rows.

Integer codes (engine.model.quant.linear.kernel_pack's layout): a step's words are unpacked one slot at a time,
`(word >> bits*q) & mask` (shifts and masks: no interleave, so no layout conversion before the dot), and each
slot is its own dot over the step's words against the activations of that slot's inputs; the sum of the slots'
dots is the step's product. The code becomes an exact fp32 by the or-with-2^23 trick, then the dot's dtype.
- a group that spans the step (group 128 and up): `dot(x, u) * scale + sum(x) * offset` per step;
- smaller groups (GGUF's 32 and 16): the step's words are expanded with their run's scale before the dot.
FP8: the e4m3 bytes convert to the activations' dtype (exact), and a per-channel scale multiplies the finished
sum, a block scale the step's product.

`finish` (shared with engine.model.quant.gemv): split K's ordered reduction (engine.model.triton_linear's
counters): each split stores an fp32 partial sum, the last of a tile's splits adds them in split order.
"""

from __future__ import annotations

import triton
import triton.language as tl


_MAGIC_F = tl.constexpr(8388608.0)  # 2^23: a code or-ed into the low mantissa of its fp32 bits (magic) is 2^23 + code


@triton.jit
def int_tc_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, KW, kw_per_split,
                  stride_xm, stride_qn, stride_sn, stride_om, magic: tl.constexpr,
                  GROUP: tl.constexpr, BITS: tl.constexpr, RUN: tl.constexpr, SCALES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = CPW // 2
    MASK: tl.constexpr = (1 << BITS) - 1
    split, rm, rn, m_ok, n_ok, rn64, q_rows = program_tile(q_ptr, stride_qn, M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_start = split * kw_per_split
    for w0 in range(w_start, w_start + kw_per_split, BLOCK_KW):
        ws, w_ok, words, base = step_words(q_rows, n_ok, w0, KW, RUN, CPW, BLOCK_KW, EVEN_K)
        if SCALES == 1:
            step = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M, BLOCK_KW], dtype=tl.float32)  # summed over the slots, reduced once a step
        else:
            g = ((ws // RUN) * (RUN * CPW)) // GROUP
            g_ok = n_ok[:, None] & w_ok[None, :]
            s = tl.load(s_ptr + rn64[:, None] * stride_sn + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn64[:, None] * stride_sn + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
        for j in tl.static_range(CPW):
            code = (words >> (BITS * j)) & MASK
            u = (code | magic).to(tl.float32, bitcast=True) - _MAGIC_F  # gemv.MAGIC_BITS as a constant: as a
            # run-time value (the GEMV takes it so) Triton stages each unpacked tile through shared memory for the dot
            k = base + RUN * j
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (w_ok & ((k < K) | EVEN_K))[None, :], other=0.0)
            if SCALES == 1:
                step = tl.dot(x, tl.trans(u.to(x.dtype)), step)
                x_sum += x.to(tl.float32)
            else:
                acc = tl.dot(x, tl.trans((u * s + o).to(x.dtype)), acc)
        if SCALES == 1:
            g = (tl.minimum(w0, KW - 1) * CPW) // GROUP  # a split's last step may lie past K (an empty product)
            s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            # two explicit fmas: left to the compiler, which product it fuses may differ between row tiles
            acc = tl.fma(step, s[None, :], tl.fma(tl.sum(x_sum, axis=1)[:, None], o[None, :], acc))
    finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om, SPLIT, HAS_BIAS)


@triton.jit
def program_tile(q_ptr, stride_qn, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """An int kernel's program: its split, rows and columns (with their masks), and its columns' code words."""
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)
    return tl.program_id(1), rm, rn, rm < M, rn < N, rn64, q_ptr + rn64[:, None] * stride_qn


@triton.jit
def step_words(q_rows, n_ok, w0, KW, RUN: tl.constexpr, CPW: tl.constexpr, BLOCK_KW: tl.constexpr,
               EVEN_K: tl.constexpr):
    """A K step's words from `w0`, unsigned (so that a shift right brings in zeros: one shift and one mask a code);
    their mask along K (EVEN_K: every step whole, no mask, fewer instructions a code); each word's slot-0 input."""
    ws = w0 + tl.arange(0, BLOCK_KW)
    w_ok = (ws < KW) | EVEN_K
    words = tl.load(q_rows + ws[None, :], mask=n_ok[:, None] & w_ok[None, :], other=0).to(tl.uint32, bitcast=True)
    return ws, w_ok, words, (ws // RUN) * (RUN * CPW) + ws % RUN


@triton.jit
def fp8_tc_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
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
            # a split's last step may lie past K (an empty product): its scale index stays in the tensor
            s = tl.load(s_rows + tl.minimum(k0, K - 1) // SCALE_BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s[None, :]
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if SCALES == 0:
        acc = acc * tl.load(s_rows, mask=n_ok, other=0.0)[None, :]
    finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om, SPLIT, HAS_BIAS)


@triton.jit
def finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, m_ok, n_ok, M, N, split, stride_om,
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
