"""Routed experts of a decode or verify step as GEMVs: a program per (route, column tile), no tensor-core dot.

A decode step at batch 1-25 routes each token to k experts that mostly no other token of the step shares, so a
tensor-core tile of 16 routes holds one real row and the step is bound by how fast each expert's weights turn into
products. So each program reads one route's expert weights in place through its slot (vector loads along K, as
stored), multiplies them by the route's activation row in fp32 and reduces each output over K once, after the
loop. Routes sharing an expert read its tiles at the same time (the route is the grid's fastest axis), so the
second read is the L2's. Each route's sums depend on its own row and expert only: a route gets the same bits in a
decode step, a verify step and an eager re-run of any size this path takes.

Formats (FMT): 0, 16/32-bit pools; 1, FP8 (e4m3 converted in registers, the per-channel scale applied to each
finished sum); 2, 4-bit codes (engine.model.quant.linear.kernel_pack's layout, a scale and offset per group),
unpacked as engine.model.quant.gemv unpacks them: a code becomes an exact fp32 by one mask-and-or, its activation
pre-scaled by a power of two, and the group's scale and offset reach the step's partial sum, not each weight.
Gate and up rows of a column tile are one tile of 2 x BLOCK_N rows (one loop, twice the loads in flight); SiLU x
up and the routing weight are the epilogues engine.model.moe_blocks shares with the tensor-core kernels.
"""

from __future__ import annotations

import torch

from engine.model.moe_blocks import MoELaunch
from engine.model.moe_quant import CODES_PER_WORD, ExpertQuant, Fp8Experts, Int4Experts

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it (the torch backend serves then)
    import triton
    import triton.language as tl

    from engine.model.moe_blocks import store_act, store_routed
    from engine.model.quant.gemv import MAGIC_BITS, code_f32, scaled_step, unscaled
except ImportError:  # pragma: no cover
    triton = None

FMT_16BIT, FMT_FP8, FMT_INT4 = 0, 1, 2


def _format(quant: ExpertQuant | None) -> int:
    if isinstance(quant, Int4Experts):
        return FMT_INT4
    return FMT_FP8 if isinstance(quant, Fp8Experts) else FMT_16BIT


if triton is not None:

    @triton.jit
    def _rows_dot(w_rows, s_rows, o_rows, x_row, K, n_ok, magic, FMT: tl.constexpr, GROUP: tl.constexpr,
                  RUN: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """[ROWS] fp32 sums over K of each weight row times x_row (FP8: before its scale). w_rows, s_rows, o_rows:
        [ROWS, 1] row starts (s_rows / o_rows: the 4-bit groups' scales and offsets)."""
        if FMT == 2:
            BLOCK_KW: tl.constexpr = BLOCK_K // 8
            KW = K // 8
            acc = tl.zeros([ROWS, BLOCK_KW], dtype=tl.float32)
            for w0 in range(0, KW, BLOCK_KW):
                ws = w0 + tl.arange(0, BLOCK_KW)
                w_ok = (ws < KW) | EVEN_K  # EVEN_K: every step whole, no mask along K (fewer instructions a code)
                tile_ok = n_ok[:, None] & w_ok[None, :]
                words = tl.load(w_rows + ws[None, :], mask=tile_ok, other=0)
                hi = words >> 16
                base = (ws // RUN) * (RUN * 8) + ws % RUN  # the input of each word's slot 0
                for j in tl.static_range(8):
                    if j < 4:
                        f = code_f32(words, 4, j % 4, magic)
                    else:
                        f = code_f32(hi, 4, j % 4, magic)
                    x = tl.load(x_row + base + RUN * j, mask=w_ok, other=0.0).to(tl.float32)
                    if j == 0:  # the step's sums start from the first products, not from zeros
                        xs = x
                        p = f * x[None, :]
                    else:
                        xs += x
                        p += f * unscaled(x, 4, j % 4)[None, :]
                if GROUP % BLOCK_K == 0:  # the step lies in one group: a scale and an offset per row
                    g = (w0 * 8) // GROUP
                    s = tl.load(s_rows + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
                    o = tl.load(o_rows + g, mask=n_ok[:, None], other=0.0).to(tl.float32)
                else:  # a run's words lie in one group
                    g = ((ws // RUN) * (RUN * 8)) // GROUP
                    s = tl.load(s_rows + g[None, :], mask=tile_ok, other=0.0).to(tl.float32)
                    o = tl.load(o_rows + g[None, :], mask=tile_ok, other=0.0).to(tl.float32)
                acc = scaled_step(acc, p, xs, s, o)
        else:
            acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = (ks < K) | EVEN_K
                w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
                acc += w * x[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _route(slots_ptr):
        """This program's route (a [1] vector, as the shared epilogues take a block of routes) and its slot."""
        r = tl.program_id(0)
        return r + tl.zeros([1], dtype=tl.int64), tl.load(slots_ptr + r)

    @triton.jit
    def _gate_up_gemv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, slots_ptr, act_ptr, H, I, TOP_K, stride_xn, stride_ws,
                             stride_wn, stride_ss, stride_sn, stride_ar, magic, FMT: tl.constexpr, GROUP: tl.constexpr,
                             RUN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr):
        routes, slot = _route(slots_ptr)
        if slot < 0:
            return
        # rows i < BLOCK_N: gate column c + i; the rest: up column c + i - BLOCK_N (row I + that of the pool)
        i = tl.arange(0, 2 * BLOCK_N)
        col = tl.program_id(1) * BLOCK_N + i % BLOCK_N
        n_ok = col < I
        row = (col + (i // BLOCK_N) * I).to(tl.int64)
        slot64 = slot.to(tl.int64)
        s_rows = s_ptr + slot64 * stride_ss + row[:, None] * stride_sn
        o_rows = o_ptr + slot64 * stride_ss + row[:, None] * stride_sn
        x_row = x_ptr + (tl.program_id(0) // TOP_K).to(tl.int64) * stride_xn
        sums = _rows_dot(w_ptr + slot64 * stride_ws + row[:, None] * stride_wn, s_rows, o_rows, x_row,
                         H, n_ok, magic, FMT, GROUP, RUN, 2 * BLOCK_N, BLOCK_K, EVEN_K)
        if FMT == 1:  # one scale per output channel: on the finished sums
            sums *= tl.load(s_ptr + slot64 * stride_ss + row, mask=n_ok, other=0.0)
        halves = tl.reshape(sums, (2, BLOCK_N))
        first = tl.arange(0, 2)[:, None] == 0
        gate = tl.sum(tl.where(first, halves, 0.0), axis=0)
        up = tl.sum(tl.where(first, 0.0, halves), axis=0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        store_act(gate[None, :], up[None, :], act_ptr, routes, routes >= 0, rn, rn < I, stride_ar)

    @triton.jit
    def _down_gemv_kernel(act_ptr, w_ptr, s_ptr, o_ptr, rw_ptr, slots_ptr, y_ptr, H, I, stride_ar, stride_ws,
                          stride_wn, stride_ss, stride_sn, stride_yr, magic, FMT: tl.constexpr, GROUP: tl.constexpr,
                          RUN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        routes, slot = _route(slots_ptr)
        if slot < 0:
            return
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < H
        row = rn.to(tl.int64)
        slot64 = slot.to(tl.int64)
        s_rows = s_ptr + slot64 * stride_ss + row[:, None] * stride_sn
        o_rows = o_ptr + slot64 * stride_ss + row[:, None] * stride_sn
        a_row = act_ptr + tl.program_id(0).to(tl.int64) * stride_ar
        sums = _rows_dot(w_ptr + slot64 * stride_ws + row[:, None] * stride_wn, s_rows, o_rows, a_row,
                         I, n_ok, magic, FMT, GROUP, RUN, BLOCK_N, BLOCK_K, EVEN_K)
        if FMT == 1:
            sums *= tl.load(s_ptr + slot64 * stride_ss + row, mask=n_ok, other=0.0)
        store_routed(sums[None, :], y_ptr, rw_ptr, routes, routes >= 0, rn, n_ok, stride_yr)


def _scales(quant: ExpertQuant | None, pool: torch.Tensor, which: str) -> dict:
    """One projection's scales and offsets (with their slot and row strides), group and run, as launch arguments;
    unread stand-ins for a 16-bit pool."""
    if isinstance(quant, Int4Experts):
        s, o = getattr(quant, f"{which}_scales"), getattr(quant, f"{which}_offsets")
        group, run = getattr(quant, f"{which}_group"), getattr(quant, f"{which}_run")
    else:
        s = o = getattr(quant, f"{which}_scale") if isinstance(quant, Fp8Experts) else pool
        group = run = 1
    return dict(s_ptr=s, o_ptr=o, stride_ss=s.stride(0), stride_sn=s.stride(1) if s.dim() > 2 else 1, GROUP=group,
                RUN=run)


def launch_gemv(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slots: torch.Tensor,
                w_flat: torch.Tensor, act: torch.Tensor, y: torch.Tensor, k: int, launch: MoELaunch,
                quant: ExpertQuant | None) -> None:
    """engine.model.moe_kernels._routed_triton's two launches as GEMVs: act [R, I] <- SiLU(gate) x up, then
    y [R, H] <- down x act x the routing weight, a program per route and column tile (slots [R], < 0: skip)."""
    R, (I, H) = slots.numel(), (act.shape[1], x.shape[1])
    fmt = _format(quant)
    if fmt == FMT_INT4 and launch.block_k < 4 * CODES_PER_WORD:
        raise ValueError(f"launch {launch.label()}: a 4-bit GEMV steps {4 * CODES_PER_WORD} inputs (4 words) at least")
    common = dict(magic=MAGIC_BITS, FMT=fmt, BLOCK_K=launch.block_k, num_warps=launch.num_warps,
                  num_stages=launch.num_stages)
    _gate_up_gemv_kernel[(R, triton.cdiv(I, launch.gate_up_n))](
        x_ptr=x, w_ptr=gate_up, slots_ptr=slots, act_ptr=act, H=H, I=I, TOP_K=k, stride_xn=x.stride(0),
        stride_ws=gate_up.stride(0), stride_wn=gate_up.stride(1), stride_ar=act.stride(0), BLOCK_N=launch.gate_up_n,
        EVEN_K=H % launch.block_k == 0, **_scales(quant, gate_up, "gate_up"), **common)
    _down_gemv_kernel[(R, triton.cdiv(H, launch.down_n))](
        act_ptr=act, w_ptr=down, rw_ptr=w_flat, slots_ptr=slots, y_ptr=y, H=H, I=I, stride_ar=act.stride(0),
        stride_ws=down.stride(0), stride_wn=down.stride(1), stride_yr=y.stride(0), BLOCK_N=launch.down_n,
        EVEN_K=I % launch.block_k == 0, **_scales(quant, down, "down"), **common)
