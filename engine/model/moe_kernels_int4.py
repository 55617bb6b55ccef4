"""The fused MoE kernels of 4-bit pools (engine.model.moe_quant.Int4Experts): engine.model.moe_kernels' two launches,
gate and up with SiLU x up, then down with the routing weight, over pools of packed codes.

The codes are engine.model.quant.linear.kernel_pack's int32 words (`gate_up [S, 2I, H / 8]`, `down [S, H, I / 8]`,
slot j of word w of each run of RUN words holding input run * j + w of the run), each group of inputs with a scale
and an offset (`[S, N, K / group]`). A program finds its block of routes and its expert's slot as the 16-bit
kernels do (engine.model.moe_blocks.block_program: the same scan and sort layouts, no host sync, graph-safe) and
reads the slot's words in place; each step of BLOCK_KW words is unpacked one slot at a time as
engine.model.quant.tensor_core.int_tc_kernel does: `(word >> 4j) & 15` (the words unsigned, so a shift brings in
zeros), made an exact fp32 by the or-with-2^23 trick, then `u * scale + offset` with its word's group scale and
offset (a run lies in one group), in fp32 without fused multiply-adds and rounded to the activations' dtype: the
weight the reference (IntGroupLinear.dequantize, the torch backends) multiplies, bit for bit. One tensor-core dot
per slot against the activations of that slot's inputs then accumulates each output over K alone, so a route's
result does not depend on the other routes of its block, as in the 16-bit kernels.
"""

from __future__ import annotations

import torch

from engine.model.moe_blocks import MoELaunch
from engine.model.moe_quant import CODES_PER_WORD, Int4Experts

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it (the torch backend serves then)
    import triton
    import triton.language as tl

    from engine.model.moe_blocks import block_program, store_act, store_routed
except ImportError:  # pragma: no cover
    triton = None


def int4_block_kw(launch: MoELaunch) -> int:
    """Words a 4-bit step reads along K: the launch's BLOCK_K inputs, at least 16 words (a tensor-core dot's K
    of 16 per slot)."""
    return max(16, launch.block_k // CODES_PER_WORD)


if triton is not None:

    _MAGIC = tl.constexpr(0x4B000000)  # fp32 bits of 2^23: a code or-ed into the low mantissa is 2^23 + code
    _MAGIC_F = tl.constexpr(8388608.0)

    @triton.jit
    def _int4_words(q_rows, s_rows, o_rows, ws, tile_ok, RUN: tl.constexpr, GROUP: tl.constexpr):
        """One step's words [BLOCK_N, BLOCK_KW] (unsigned: a shift right brings in zeros) and each word's group
        scale and offset (a run lies in one group), fp32; masked words are 0 with scale and offset 0."""
        words = tl.load(q_rows + ws[None, :], mask=tile_ok, other=0).to(tl.uint32, bitcast=True)
        g = ((ws // RUN) * (RUN * 8)) // GROUP
        s = tl.load(s_rows + g[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        o = tl.load(o_rows + g[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        return words, s, o

    @triton.jit
    def _int4_weights(words, s, o, j: tl.constexpr, dtype: tl.constexpr):
        """Slot j of each word (inputs run * j + w of its run) as [BLOCK_KW, BLOCK_N] weights: the code made an
        exact fp32 by the or-with-2^23 trick, then u * scale + offset in fp32 rounded to `dtype`, as
        IntGroupLinear.dequantize computes the reference's weight (the launch turns fused multiply-adds off)."""
        u = (((words >> (4 * j)) & 15) | _MAGIC).to(tl.float32, bitcast=True) - _MAGIC_F
        return tl.trans((u * s + o).to(dtype))

    @triton.jit
    def _gate_up_int4_kernel(x_ptr, q_ptr, s_ptr, o_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr,
                             act_ptr, R, I, KW, TOP_K, stride_xn, stride_qs, stride_qn, stride_ss, stride_sn,
                             stride_ar, GROUP: tl.constexpr, RUN: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SCAN: tl.constexpr,
                             SCAN_R: tl.constexpr, PRECISION: tl.constexpr):
        slot, routes, ok, rn, n_ok = block_program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, I,
                                              BLOCK_M, BLOCK_N, SCAN, SCAN_R)
        if slot < 0:
            return
        a_rows = x_ptr + (routes // TOP_K).to(tl.int64)[:, None] * stride_xn
        rn64 = rn.to(tl.int64)[:, None]
        q_gate = q_ptr + slot.to(tl.int64) * stride_qs + rn64 * stride_qn  # [BLOCK_N, 1] row starts
        s_gate = s_ptr + slot.to(tl.int64) * stride_ss + rn64 * stride_sn
        o_gate = o_ptr + slot.to(tl.int64) * stride_ss + rn64 * stride_sn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for w0 in range(0, KW, BLOCK_KW):
            ws = w0 + tl.arange(0, BLOCK_KW)
            w_ok = ws < KW
            tile_ok = n_ok[:, None] & w_ok[None, :]
            wg, sg, og = _int4_words(q_gate, s_gate, o_gate, ws, tile_ok, RUN, GROUP)
            wu, su, ou = _int4_words(q_gate + I * stride_qn, s_gate + I * stride_sn, o_gate + I * stride_sn, ws,
                                     tile_ok, RUN, GROUP)
            base = (ws // RUN) * (RUN * 8) + ws % RUN  # the input of each word's slot 0
            for j in tl.static_range(8):  # one dot per slot, against the activations of that slot's inputs
                a = tl.load(a_rows + (base + RUN * j)[None, :], mask=ok[:, None] & w_ok[None, :], other=0.0)
                acc_gate = tl.dot(a, _int4_weights(wg, sg, og, j, a.dtype), acc_gate, input_precision=PRECISION)
                acc_up = tl.dot(a, _int4_weights(wu, su, ou, j, a.dtype), acc_up, input_precision=PRECISION)
        store_act(acc_gate, acc_up, act_ptr, routes, ok, rn, n_ok, stride_ar)

    @triton.jit
    def _down_int4_kernel(act_ptr, q_ptr, s_ptr, o_ptr, rw_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr,
                          starts_ptr, y_ptr, R, H, KW, stride_ar, stride_qs, stride_qn, stride_ss, stride_sn,
                          stride_yr, GROUP: tl.constexpr, RUN: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SCAN: tl.constexpr, SCAN_R: tl.constexpr,
                          PRECISION: tl.constexpr):
        slot, routes, ok, rn, n_ok = block_program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, H,
                                              BLOCK_M, BLOCK_N, SCAN, SCAN_R)
        if slot < 0:
            return
        a_rows = act_ptr + routes.to(tl.int64)[:, None] * stride_ar
        rn64 = rn.to(tl.int64)[:, None]
        q_rows = q_ptr + slot.to(tl.int64) * stride_qs + rn64 * stride_qn
        s_rows = s_ptr + slot.to(tl.int64) * stride_ss + rn64 * stride_sn
        o_rows = o_ptr + slot.to(tl.int64) * stride_ss + rn64 * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for w0 in range(0, KW, BLOCK_KW):
            ws = w0 + tl.arange(0, BLOCK_KW)
            w_ok = ws < KW
            words, s, o = _int4_words(q_rows, s_rows, o_rows, ws, n_ok[:, None] & w_ok[None, :], RUN, GROUP)
            base = (ws // RUN) * (RUN * 8) + ws % RUN
            for j in tl.static_range(8):
                a = tl.load(a_rows + (base + RUN * j)[None, :], mask=ok[:, None] & w_ok[None, :], other=0.0)
                acc = tl.dot(a, _int4_weights(words, s, o, j, a.dtype), acc, input_precision=PRECISION)
        store_routed(acc, y_ptr, rw_ptr, routes, ok, rn, n_ok, stride_yr)


def launch_int4(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, w_flat: torch.Tensor, route_args: tuple,
                act: torch.Tensor, y: torch.Tensor, k: int, launch: MoELaunch, quant: Int4Experts, blocks_of: dict,
                common: dict) -> None:
    """The two launches of engine.model.moe_kernels._routed_triton (its route layout, grids and launch options)
    over 4-bit pools: act [R, I] <- SiLU(gate) x up, then y [R, H] <- down x act x the routing weight."""
    R, (I, H) = act.shape[0], (act.shape[1], x.shape[1])
    for name, codes, scales, offsets in (("gate_up", gate_up, quant.gate_up_scales, quant.gate_up_offsets),
                                         ("down", down, quant.down_scales, quant.down_offsets)):
        if codes.dtype != torch.int32 or scales.stride() != offsets.stride() or scales.stride(-1) != 1:
            raise ValueError(f"routed_experts: the 4-bit {name} pool must be int32 words with scales and offsets "
                             "of one contiguous layout")
    # no fused multiply-add: each weight is `u * scale` rounded, then `+ offset` rounded, as the reference's
    # dequantization computes it, so the kernels multiply the very weights the torch backends do
    common = dict(common, BLOCK_KW=int4_block_kw(launch), enable_fp_fusion=False)
    s, o = quant.gate_up_scales, quant.gate_up_offsets
    _gate_up_int4_kernel[blocks_of["gate_up"]](
        x, gate_up, s, o, *route_args, act, R, I, gate_up.shape[-1], k, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), s.stride(0), s.stride(1), act.stride(0), GROUP=quant.gate_up_group,
        RUN=quant.gate_up_run, BLOCK_N=launch.gate_up_n, **common)
    s, o = quant.down_scales, quant.down_offsets
    _down_int4_kernel[blocks_of["down"]](
        act, down, s, o, w_flat, *route_args, y, R, H, down.shape[-1], act.stride(0), down.stride(0),
        down.stride(1), s.stride(0), s.stride(1), y.stride(0), GROUP=quant.down_group, RUN=quant.down_run,
        BLOCK_N=launch.down_n, **common)
