"""The 1-4 row path of the quantized kernels: a GEMV with no tensor-core dot (engine.model.quant.kernels picks it).

At a few rows a tensor-core tile of 16 rows wastes most of its work and, worse, moves every expanded weight
through shared memory into the dot's operand layout; a decode step at batch 1 is bound by how fast the SM turns
quantized bytes into fp32 multiply-adds. So each program holds a [BLOCK_N, BLOCK_K] slab of the weight in
registers as loaded (16-byte vectors along K), multiplies it by each row's activations in fp32, and keeps one
fp32 accumulator per row of that slab's shape: the sum over K is reduced across threads once, after the loop.

Integer codes (the layout of engine.model.quant.linear.kernel_pack): a code is made an exact fp32 by one mask
and or: `(word & (15 << 4q)) | 0x4B000000` is the float 2^23 + code * 16^q (q the code's place in its 16-bit
half), so minus 2^23 it is code * 16^q exactly, and the activation it meets was multiplied by 16^-q (exact, a
power of two) when loaded. A run of 4 words holds 32 (int8: 16) inputs with each slot's inputs side by side, so
those activations load as short vectors. Scales go to partial sums, never to each weight: a word's 8 (4) codes lie
in one group, so each step's per-word partial sum is scaled once (`p * scale + sum(x) * offset`), per word or,
where the group spans the whole step, per column.

FP8: the e4m3 bytes convert to fp32 (the hardware's conversion on sm_89 and up); a per-channel scale multiplies
the finished sum, a block scale the activations of its step (every column of a program lies in one scale block).

Rows come in groups of 4, a program per group and column tile (a group's weight slab read once; the groups of
a tile run side by side, so its later reads are the L2's). Split K as in engine.model.triton_linear: each split
stores its rows' fp32 partial sums and the last split to finish adds them in split order. A row's arithmetic does
not depend on the other rows (each has its own accumulator; the launch shape follows the weight), so a verify
step computes each row exactly as a decode step of one row does (engine.model.quant.kernels picks the path of a
step by its sequences, so both take this one).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.model.pdl import gdc_start
from engine.model.quant.tensor_core import finish

# fp32 bits of 2^23: a value or-ed into the low 23 bits of the mantissa is an exact integer above 2^23. The GEMVs
# take it as a run-time argument (`magic`, MAGIC_BITS): sm_90's lop3 has one immediate operand, so with the mask and
# this both constants ptxas spends a second instruction a code on them (an and and an or, or a mov and the lop3),
# and the GEMV is bound by its instructions.
MAGIC_BITS = 0x4B000000
_MAGIC = tl.constexpr(MAGIC_BITS)
_MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def code_f32(src, BITS: tl.constexpr, Q: tl.constexpr, magic=_MAGIC):
    """Code Q of `src`'s low 16 bits as the exact fp32 code * 2^(BITS*Q) (one lop3 and one add; `magic`:
    MAGIC_BITS, a kernel argument where the lop3 should take it from a register)."""
    return ((src & (((1 << BITS) - 1) << (BITS * Q))) | magic).to(tl.float32, bitcast=True) - _MAGIC_F


@triton.jit
def unscaled(x, BITS: tl.constexpr, Q: tl.constexpr):
    """x * 2^-(BITS*Q): exact (a power of two), so (code * 2^(BITS*Q)) * this is code * x exactly."""
    return x * (1.0 / (1 << (BITS * Q)))


@triton.jit
def scaled_step(acc, p, xs, s, o):
    """acc + p * s + xs * o as two explicit fmas. Left as products and sums, the compiler may fuse either product
    into an fma, and its choice may differ between the kernel's 1-row and 4-row builds: a row's sum would then
    differ in its last bits between a decode step and a verify step (MTP on != off). An fma has one rounding."""
    return tl.fma(p, s, tl.fma(xs[None, :], o, acc))


@triton.jit
def _x_slot(x_ptr, row_offset, k, k_ok):
    return tl.load(x_ptr + row_offset + k, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit
def _stack_rows(a0, a1, a2, a3, ROWS: tl.constexpr, RB: tl.constexpr):
    """The rows' [BLOCK_N] sums as one [RB, BLOCK_N] tile (for the shared split-K finish)."""
    r = tl.arange(0, RB)[:, None]
    out = tl.where(r == 0, a0[None, :], 0.0)
    if ROWS > 1:
        out = tl.where(r == 1, a1[None, :], out)
    if ROWS > 2:
        out = tl.where(r == 2, a2[None, :], out)
    if ROWS > 3:
        out = tl.where(r == 3, a3[None, :], out)
    return out


@triton.jit
def int_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, KW, kw_per_split,
                    stride_xm, stride_qn, stride_sn, stride_om, magic,
                    GROUP: tl.constexpr, BITS: tl.constexpr, RUN: tl.constexpr, SCALES: tl.constexpr,
                    ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    CPW: tl.constexpr = 32 // BITS  # codes per word
    HALF: tl.constexpr = CPW // 2  # codes per 16-bit half of a word
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * 4  # this program's group of (up to) 4 rows
    x_ptr += row0 * stride_xm
    last = M - row0 - 1  # rows past the last read the last one's activations: computed, never stored
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    q_rows = q_ptr + rn64[:, None] * stride_qn
    wi = tl.arange(0, BLOCK_KW)
    acc0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    w_start = split * kw_per_split
    for w0 in range(w_start, w_start + kw_per_split, BLOCK_KW):
        ws = w0 + wi
        w_ok = (ws < KW) | EVEN_K  # EVEN_K: every step whole, no mask along K (fewer instructions a code)
        words = tl.load(q_rows + ws[None, :], mask=n_ok[:, None] & w_ok[None, :], other=0)
        hi = words >> 16
        base = (ws // RUN) * (RUN * CPW) + ws % RUN  # the input of each word's slot 0
        p0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
        p1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
        p2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
        p3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
        xs0 = tl.zeros([BLOCK_KW], dtype=tl.float32)
        xs1 = tl.zeros([BLOCK_KW], dtype=tl.float32)
        xs2 = tl.zeros([BLOCK_KW], dtype=tl.float32)
        xs3 = tl.zeros([BLOCK_KW], dtype=tl.float32)
        for j in tl.static_range(CPW):
            # slot j: code j % HALF of the word's low or high 16 bits; its activation scaled by 2^-(BITS * that)
            if j < HALF:
                f = code_f32(words, BITS, j % HALF, magic)
            else:
                f = code_f32(hi, BITS, j % HALF, magic)
            k = base + RUN * j
            k_ok = w_ok & ((k < K) | EVEN_K)
            x = _x_slot(x_ptr, 0, k, k_ok)
            xs0 += x
            p0 += f * unscaled(x, BITS, j % HALF)[None, :]
            if ROWS > 1:
                x = _x_slot(x_ptr, stride_xm * tl.minimum(1, last), k, k_ok)
                xs1 += x
                p1 += f * unscaled(x, BITS, j % HALF)[None, :]
            if ROWS > 2:
                x = _x_slot(x_ptr, stride_xm * tl.minimum(2, last), k, k_ok)
                xs2 += x
                p2 += f * unscaled(x, BITS, j % HALF)[None, :]
            if ROWS > 3:
                x = _x_slot(x_ptr, stride_xm * tl.minimum(3, last), k, k_ok)
                xs3 += x
                p3 += f * unscaled(x, BITS, j % HALF)[None, :]
        if SCALES == 1:  # the whole step lies in one group: a scale and an offset per column
            g = (tl.minimum(w0, KW - 1) * CPW) // GROUP  # a split's last step may lie past K (an empty product)
            s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            o = tl.load(o_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        else:  # a group per run of words
            g = ((ws // RUN) * (RUN * CPW)) // GROUP
            g_ok = n_ok[:, None] & w_ok[None, :]
            s = tl.load(s_ptr + rn64[:, None] * stride_sn + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn64[:, None] * stride_sn + g[None, :], mask=g_ok, other=0.0).to(tl.float32)
        acc0 = scaled_step(acc0, p0, xs0, s, o)
        if ROWS > 1:
            acc1 = scaled_step(acc1, p1, xs1, s, o)
        if ROWS > 2:
            acc2 = scaled_step(acc2, p2, xs2, s, o)
        if ROWS > 3:
            acc3 = scaled_step(acc3, p3, xs3, s, o)
    acc = _stack_rows(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
                      ROWS, RB)
    rm = row0 + tl.arange(0, RB)
    finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, rm < M, n_ok, M, N, split, stride_om, SPLIT, HAS_BIAS)


@triton.jit
def fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                    stride_xm, stride_wn, stride_sn, stride_om,
                    SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, SCALES: tl.constexpr,
                    NATIVE_FP8: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * 4  # this program's group of (up to) 4 rows
    x_ptr += row0 * stride_xm
    last = M - row0 - 1  # rows past the last read the last one's activations: computed, never stored
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (rn // SCALE_BLOCK_N).to(tl.int64) * stride_sn
    # a block scale shared by every column of the program scales the step's activations instead of its weights
    X_SCALED: tl.constexpr = SCALES == 1 and SCALE_BLOCK_N % BLOCK_N == 0
    s_block = s_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK_N).to(tl.int64) * stride_sn
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        tile_ok = n_ok[:, None] & k_ok[None, :]
        if NATIVE_FP8:
            w = tl.load(w_rows + ks[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        else:  # before sm_89: the byte's exponent rebiased into an fp32's (as the tensor-core kernel does)
            bits = tl.load(w_rows + ks[None, :], mask=tile_ok, other=0).to(tl.int32)
            mag = bits & 0x7F
            normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
            w = tl.where(mag >= 8, normal, (mag & 7).to(tl.float32) * 0.001953125)
            w = tl.where((bits & 0x80) != 0, -w, w)
        x_scale = 1.0
        if X_SCALED:
            x_scale = tl.load(s_block + tl.minimum(k0, K - 1) // SCALE_BLOCK_K)  # (a step past K: its last block)
        elif SCALES == 1:
            w = w * tl.load(s_rows + tl.minimum(k0, K - 1) // SCALE_BLOCK_K, mask=n_ok, other=0.0)[:, None]
        elif SCALES == 2:
            w = w * tl.load(s_rows[:, None] + (ks // SCALE_BLOCK_K)[None, :], mask=tile_ok, other=0.0)
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32) * x_scale
        acc0 += w * x[None, :]
        if ROWS > 1:
            x = tl.load(x_ptr + tl.minimum(1, last) * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32) * x_scale
            acc1 += w * x[None, :]
        if ROWS > 2:
            x = tl.load(x_ptr + tl.minimum(2, last) * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32) * x_scale
            acc2 += w * x[None, :]
        if ROWS > 3:
            x = tl.load(x_ptr + tl.minimum(3, last) * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32) * x_scale
            acc3 += w * x[None, :]
    acc = _stack_rows(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
                      ROWS, RB)
    if SCALES == 0:
        acc = acc * tl.load(s_rows, mask=n_ok, other=0.0)[None, :]
    rm = row0 + tl.arange(0, RB)
    finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, rm, rn, rm < M, n_ok, M, N, split, stride_om, SPLIT, HAS_BIAS)
