"""Routed experts in two launches: every (token, expert) pair of a step, each expert's weights read in place.

    y = routed_experts(x, gate_up, down, slots, weights)   # x [N, H], slots / weights [N, k] -> y [N, k, H]
    out = y.sum(dim=1)                                     # the MoE block's output

`gate_up [S, 2I, H]` (gate rows first) and `down [S, H, I]` are a pool of S expert slots (the expert cache's, or
an all-resident stack); `slots[n, j]` is the slot of token n's j-th routed expert, and a negative slot leaves
`y[n, j]` as it was (a route another path serves, or a padding row). `y[n, j] = weights[n, j] * expert(x[n])`,
rounded as the reference path rounds it (engine.model.moe.expert_mlp, then the routing weight, in x's dtype), and
the block's sum over j happens once, in one order, whatever served each route: so the all-resident, cold-copy,
prefetch and eager re-run paths give the same bits.

Backends:
- `triton` (CUDA; the tests run it in Triton's interpreter): the routes are grouped by slot into blocks of at
  most BLOCK_M routes, and one program per (block, column tile) multiplies the block's rows by its expert's
  weight tile, which it reads once from the pool. Gate and up share the A tile and the program, SiLU x up is
  applied before the store; the down product applies the routing weight before its store. A row's result does
  not depend on the other rows of its block (tensor-core tiles accumulate each output over K alone), and the
  launch shape depends on the route count only, so a route gets the same bits in a decode step, its eager re-run
  and a verify step of the same size. Blocks are found without a host sync, so the launches are capturable:
  with few routes each program scans the step's routes for the other routes of its slot (no sort, no extra
  launch); with many (a prompt chunk) a sort by slot lays the blocks out first. A decode or verify step (up to
  SCAN_MAX_ROUTES routes) takes a block of one route by default: the GEMV of engine.model.moe_gemv, a program per
  route and column tile, no tensor-core dot (such a step's routes mostly have an expert to themselves).
  Quantized pools (`quant`, engine.model.moe_quant) are read in place too: FP8 weights convert exactly to the
  activations' dtype and the per-channel scale multiplies each finished sum; 4-bit pools (int32 words in
  engine.model.quant.linear.kernel_pack's layout, a scale and offset per group) run the same two launches of
  engine.model.moe_kernels_int4, which unpack each word in registers and multiply the reference's dequantized
  weights bit for bit, `int4_block_kw(launch)` words a step. engine.model.moe_blocks holds what the formats'
  kernels share: the launch shapes, the sorted layout, a program's block of routes and the two epilogues.
- `grouped_mm`: `torch._grouped_mm` (CUTLASS grouped GEMM on Hopper) over the routes sorted by slot, the
  library alternative measured beside it by `strata-engine bench experts --moe-backends`.
- `torch`: one batched product per distinct slot, with a host sync to list them; the CPU's path and the tests'
  reference. These two dequantize a quantized pool first (the torch backend only the slots a step routes to).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.moe_blocks import MoELaunch, default_launch, sorted_blocks
from engine.model.moe_gemv import launch_gemv
from engine.model.moe_kernels_int4 import launch_int4
from engine.model.moe_quant import ExpertQuant, Fp8Experts, Int4Experts

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it
    import triton
    import triton.language as tl

    from engine.model.moe_blocks import block_program, store_act, store_routed
except ImportError:  # pragma: no cover - the torch backend serves then
    triton = None

BACKENDS = ("triton", "grouped_mm", "torch")


def backend_for(x: torch.Tensor) -> str:
    """The backend a tensor's device runs: the Triton kernels on CUDA, the torch loop elsewhere."""
    return "triton" if x.is_cuda and triton is not None else "torch"


def routed_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slots: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor | None = None, backend: str | None = None,
                   launch: MoELaunch | None = None, quant: ExpertQuant | None = None) -> torch.Tensor:
    """x [N, H], gate_up [S, 2I, H], down [S, H, I], slots [N, k] (long; < 0: skip), weights [N, k] ->
    out [N, k, H] (zeros where skipped when `out` is None) with out[n, j] = weights[n, j] * expert(x[n]).
    `quant` (engine.model.moe_quant): the pools are quantized, FP8 with one scale per output channel
    (`Fp8Experts`: the Triton kernels apply it to each finished sum) or 4-bit codes with a scale and offset per
    group (`Int4Experts`: gate_up [S, 2I, H / 8], down [S, H, I / 8] int32 words, unpacked in registers); the
    other backends dequantize first (the reference)."""
    N, H = x.shape
    k = slots.shape[1]
    if out is None:
        out = torch.zeros(N, k, H, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    backend = backend or backend_for(x)
    if backend == "triton":
        launch = launch or default_launch(N * k, four_bit=isinstance(quant, Int4Experts))
        _routed_triton(x, gate_up, down, slots, weights, out, launch, quant)
    elif backend == "grouped_mm":
        if quant is not None:
            gate_up, down = quant.dequantize(gate_up, down, x.dtype)
        _routed_grouped_mm(x, gate_up, down, slots, weights, out)
    elif backend == "torch":
        _routed_torch(x, gate_up, down, slots, weights, out, quant)
    else:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    return out


# --- torch: one product per distinct slot (host sync) -----------------------------------------------------------


def _expert_rows(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def _routed_torch(x, gate_up, down, slots, weights, out, quant: ExpertQuant | None) -> None:
    N, k = slots.shape
    flat, w_flat, y = slots.flatten(), weights.flatten(), out.view(N * k, -1)
    for s in torch.unique(flat[flat >= 0]).tolist():
        routes = torch.nonzero(flat == s).flatten()
        # a quantized slot dequantized alone (the reference's weights, without expanding the whole pool)
        w_gate_up, w_down = (gate_up[s], down[s]) if quant is None else \
            quant.at(s).dequantize(gate_up[s], down[s], x.dtype)
        y[routes] = (_expert_rows(x[routes // k], w_gate_up, w_down) * w_flat[routes, None]).to(out.dtype)


# --- grouped_mm (the library comparison) ------------------------------------------------------------------------


def _routed_grouped_mm(x, gate_up, down, slots, weights, out) -> None:
    N, k = slots.shape
    S, I2, H = gate_up.shape
    R = N * k
    key = torch.where(slots.flatten() < 0, S, slots.flatten())
    sorted_slots, routes = torch.sort(key, stable=True)
    # offs[g]: the end of group g in the sorted routes; skipped routes (key S) lie past the last end
    offs = torch.searchsorted(sorted_slots, torch.arange(S, device=x.device), right=True).to(torch.int32)
    a = x[routes // k]  # [R, H]
    h = torch._grouped_mm(a, gate_up.transpose(-2, -1), offs=offs)  # [R, 2I]
    gate, up = h.chunk(2, dim=-1)
    o = torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(-2, -1), offs=offs)  # [R, H]
    o = (o * weights.flatten()[routes, None]).to(out.dtype)
    y = out.view(R, H)
    served = (sorted_slots < S)[:, None]
    y[routes] = torch.where(served, o, y[routes])


# --- triton -------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr,
                        act_ptr, R, H, I, TOP_K, stride_xn, stride_ws, stride_wn, stride_ss, stride_ar,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr,
                        SCAN_R: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
        slot, routes, ok, rn, n_ok = block_program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, I,
                                              BLOCK_M, BLOCK_N, SCAN, SCAN_R)
        if slot < 0:
            return
        rk = tl.arange(0, BLOCK_K)
        a_rows = x_ptr + (routes // TOP_K).to(tl.int64)[:, None] * stride_xn
        w_gate = w_ptr + slot.to(tl.int64) * stride_ws + rn[None, :] * stride_wn  # [1, BLOCK_N] row starts
        w_up = w_gate + I * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < H
            a = tl.load(a_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_gate + kk[:, None], mask=w_ok, other=0.0).to(a.dtype)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_up + kk[:, None], mask=w_ok, other=0.0).to(a.dtype)  # (e4m3 -> bf16 is exact)
            acc_gate = tl.dot(a, wg, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        if SCALED:  # one scale per output channel: applied once to the finished sums
            s_row = scale_ptr + slot.to(tl.int64) * stride_ss + rn
            acc_gate *= tl.load(s_row, mask=n_ok, other=0.0)[None, :]
            acc_up *= tl.load(s_row + I, mask=n_ok, other=0.0)[None, :]
        store_act(acc_gate, acc_up, act_ptr, routes, ok, rn, n_ok, stride_ar)

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, scale_ptr, rw_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr,
                     y_ptr, R, H, I, stride_ar, stride_ws, stride_wn, stride_ss, stride_yr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr,
                     SCAN_R: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
        slot, routes, ok, rn, n_ok = block_program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, H,
                                              BLOCK_M, BLOCK_N, SCAN, SCAN_R)
        if slot < 0:
            return
        rk = tl.arange(0, BLOCK_K)
        a_rows = act_ptr + routes.to(tl.int64)[:, None] * stride_ar
        w_rows = w_ptr + slot.to(tl.int64) * stride_ws + rn[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < I
            a = tl.load(a_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a.dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SCALED:
            acc *= tl.load(scale_ptr + slot.to(tl.int64) * stride_ss + rn, mask=n_ok, other=0.0)[None, :]
        store_routed(acc, y_ptr, rw_ptr, routes, ok, rn, n_ok, stride_yr)


def _routed_triton(x, gate_up, down, slots, weights, out, launch: MoELaunch, quant: ExpertQuant | None) -> None:
    N, k = slots.shape
    S, I = gate_up.shape[0], gate_up.shape[1] // 2
    H = x.shape[1]  # not the pool's last dimension: a 4-bit pool's is words
    R = N * k
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("routed_experts: the pool's rows must be contiguous (stride 1 along K)")
    flat = slots.reshape(R).contiguous()
    w_flat = weights.reshape(R).contiguous()
    x = x.contiguous()
    act = torch.empty(R, I, dtype=x.dtype, device=x.device)
    y = out.view(R, H)
    if launch.gemv:
        launch_gemv(x, gate_up, down, flat, w_flat, act, y, k, launch, quant)
        return
    if launch.scan:
        blocks, sorted_slots, routes, starts, scan_r = R, flat, flat, flat, triton.next_power_of_2(R)
    else:
        sorted_slots, routes, starts = sorted_blocks(flat, S, launch.block_m)
        blocks, scan_r = starts.numel(), 1
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=launch.block_m, SCAN=launch.scan, SCAN_R=scan_r, PRECISION=precision,
                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    blocks_of = {"gate_up": (blocks, triton.cdiv(I, launch.gate_up_n)),
                 "down": (blocks, triton.cdiv(H, launch.down_n))}
    route_args = (flat, sorted_slots, routes, starts)
    if isinstance(quant, Int4Experts):
        launch_int4(x, gate_up, down, w_flat, route_args, act, y, k, launch, quant, blocks_of, common)
        return
    scaled = isinstance(quant, Fp8Experts)
    gate_up_scale, down_scale = quant.tensors() if scaled else (gate_up, down)  # unread when not SCALED
    common.update(BLOCK_K=launch.block_k, SCALED=scaled)
    _gate_up_kernel[blocks_of["gate_up"]](
        x, gate_up, gate_up_scale, *route_args, act, R, H, I, k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), act.stride(0),
        BLOCK_N=launch.gate_up_n, **common)
    _down_kernel[blocks_of["down"]](
        act, down, down_scale, w_flat, *route_args, y, R, H, I,
        act.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), y.stride(0),
        BLOCK_N=launch.down_n, **common)
