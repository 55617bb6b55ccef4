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
  with few routes (a decode or verify step) each program scans the step's routes for the other routes of its
  slot (no sort, no extra launch); with many (a prompt chunk) a sort by slot lays the blocks out first.
  Quantized pools (`quant`, engine.model.moe_quant) are read in place too: FP8 weights convert exactly to the
  activations' dtype and the per-channel scale multiplies each finished sum; 4-bit pools (int32 words in
  engine.model.quant.linear.kernel_pack's layout) are unpacked in registers as engine.model.quant.tensor_core
  does, one slot of each word at a time (`(word >> 4j) & 15`, exact in fp32 by the or-with-2^23 trick), each
  weight `u * scale + offset` in fp32 (no fused multiply-add) rounded to the activations' dtype: the reference's
  dequantized weight, bit for bit; then one dot per slot against the activations of that slot's inputs; a step reads
  `int4_block_kw(launch)` words (at least 16: a dot's K).
- `grouped_mm`: `torch._grouped_mm` (CUTLASS grouped GEMM on Hopper) over the routes sorted by slot, the
  library alternative measured beside it by `strata-engine bench experts --moe-backends`.
- `torch`: one batched product per distinct slot, with a host sync to list them; the CPU's path and the tests'
  reference. These two dequantize a quantized pool first (the torch backend only the slots a step routes to).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.moe_quant import CODES_PER_WORD, ExpertQuant, Fp8Experts, Int4Experts

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch backend serves then
    triton = None

BACKENDS = ("triton", "grouped_mm", "torch")
# At most this many routes a step (N * k) and the programs find their blocks by scanning the routes; above it a
# sort lays the blocks out (the scan's work grows with the square of the routes).
SCAN_MAX_ROUTES = 256


@dataclass(frozen=True)
class MoELaunch:
    """One step's launch shape: routes per block, column tiles of the two products, K per loop step, warps,
    stages, and whether blocks are found by scanning the routes (few) or by a sort (many)."""

    block_m: int
    gate_up_n: int
    down_n: int
    block_k: int
    num_warps: int
    num_stages: int
    scan: bool

    def __post_init__(self) -> None:
        for name in ("block_m", "gate_up_n", "down_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: a power of two, at least 16 (the tensor cores' tile)")

    def label(self) -> str:
        return f"{self.block_m}x{self.gate_up_n}x{self.down_n}x{self.block_k}x{self.num_warps}x{self.num_stages}"

    @staticmethod
    def parse(text: str, routes: int) -> "MoELaunch":
        """`16x32x64x128x4x4` (block_m x gate_up_n x down_n x block_k x warps x stages) for `routes` routes."""
        try:
            bm, gn, dn, bk, warps, stages = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"launch {text!r}: expected BLOCK_MxGATE_UP_NxDOWN_NxBLOCK_KxWARPSxSTAGES, "
                             "e.g. 16x32x64x128x4x4") from None
        return MoELaunch(bm, gn, dn, bk, warps, stages, scan=routes <= SCAN_MAX_ROUTES)


def default_launch(routes: int) -> MoELaunch:
    """The launch shape for a step of `routes` routes (a function of the count alone: see the module doc).
    Few routes: the weights' bytes bound the step, so narrow column tiles give every SM a share of them; many:
    the products are compute-bound, so wide blocks reuse each weight tile over many rows."""
    if routes <= SCAN_MAX_ROUTES:
        return MoELaunch(16, 32, 64, 64, 4, 5, scan=True)
    return MoELaunch(64, 64, 128, 64, 4, 3, scan=False)


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
        _routed_triton(x, gate_up, down, slots, weights, out, launch or default_launch(N * k), quant)
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


# --- blocks by sort (many routes; graph-safe) -------------------------------------------------------------------


def sorted_blocks(slots: torch.Tensor, num_slots: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots [R] (< 0: skip) -> (sorted slots [R], their routes [R], block starts [B]): routes sorted by slot
    (skipped ones last), and the sorted position of each block's first route, a block being at most `block_m`
    routes of one slot; unused starts are R. B is a bound fixed by R, S and block_m: no host sync."""
    R = slots.numel()
    key = torch.where(slots < 0, num_slots, slots)
    sorted_slots, routes = torch.sort(key, stable=True)
    pos = torch.arange(R, device=slots.device)
    starts_group = torch.ones(R, dtype=torch.bool, device=slots.device)
    starts_group[1:] = sorted_slots[1:] != sorted_slots[:-1]
    group_start = torch.cummax(torch.where(starts_group, pos, 0), dim=0).values
    leads = ((pos - group_start) % block_m == 0) & (sorted_slots < num_slots)
    bound = min(R, -(-R // block_m) + num_slots)
    starts = torch.sort(torch.where(leads, pos, R)).values[:bound]
    return sorted_slots, routes, starts


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
    def _vector(flag, like):
        """A scalar flag as a vector shaped like `like` (Triton's interpreter widens `vector & scalar` to int32,
        which a load then refuses as a mask)."""
        return (like * 0 + flag.to(tl.int32)) > 0

    @triton.jit
    def _block_routes(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, pid,
                      BLOCK_M: tl.constexpr, SCAN: tl.constexpr, SCAN_R: tl.constexpr):
        """(slot, routes [BLOCK_M], ok [BLOCK_M]) of program `pid`'s block; slot < 0: this program has none.
        SCAN: program pid is route pid, and leads a block when it is its slot's (multiple of BLOCK_M)-th route;
        its block is the routes of the same slot ranked after it. Else pid reads its block's start from the
        sorted layout (sorted_blocks)."""
        offs_m = tl.arange(0, BLOCK_M)
        if SCAN:
            r_all = tl.arange(0, SCAN_R)
            s_all = tl.load(slots_ptr + r_all, mask=r_all < R, other=-1)
            slot = tl.load(slots_ptr + pid)
            same = (s_all == slot) & (r_all < R)
            rank = tl.cumsum(same.to(tl.int32), 0) - 1  # rank of each same-slot route among them
            my_rank = tl.sum(tl.where(r_all == pid, rank, 0), 0)
            lead = (slot >= 0) & (my_rank % BLOCK_M == 0)
            match = same[None, :] & (rank[None, :] == my_rank + offs_m[:, None])  # [BLOCK_M, SCAN_R]
            routes = tl.sum(tl.where(match, r_all[None, :], 0), 1)
            ok = (tl.sum(match.to(tl.int32), 1) > 0) & _vector(lead, offs_m)
        else:
            start = tl.load(starts_ptr + pid)
            lead = start < R
            first = tl.where(lead, start, 0)
            slot = tl.load(sorted_slots_ptr + first)
            pos = first + offs_m
            ok = (pos < R) & _vector(lead, offs_m)
            ok = ok & (tl.load(sorted_slots_ptr + pos, mask=ok, other=-1) == slot)
            routes = tl.load(sorted_routes_ptr + pos, mask=ok, other=0)
        return tl.where(lead, slot, -1), routes, ok

    @triton.jit
    def _program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, N, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SCAN: tl.constexpr, SCAN_R: tl.constexpr):
        """This program's block (slot, routes, ok: _block_routes) and its output columns (rn, n_ok) of N."""
        slot, routes, ok = _block_routes(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R,
                                         tl.program_id(0), BLOCK_M, SCAN, SCAN_R)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return slot, routes, ok, rn, rn < N

    @triton.jit
    def _store_act(acc_gate, acc_up, act_ptr, routes, ok, rn, n_ok, stride_ar):
        """SiLU(gate) x up of the finished sums into the routes' rows of `act`, rounded where the reference
        rounds: F.linear's outputs, then F.silu's, then the product."""
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        act = (silu * up).to(dtype)
        tl.store(act_ptr + routes.to(tl.int64)[:, None] * stride_ar + rn[None, :], act,
                 mask=ok[:, None] & n_ok[None, :])

    @triton.jit
    def _store_routed(acc, y_ptr, rw_ptr, routes, ok, rn, n_ok, stride_yr):
        """The down product's finished sums, rounded to y's dtype (F.linear's output), times the routing weight."""
        dtype = y_ptr.dtype.element_ty
        routing = tl.load(rw_ptr + routes, mask=ok, other=0.0).to(tl.float32)
        y = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
        tl.store(y_ptr + routes.to(tl.int64)[:, None] * stride_yr + rn[None, :], y, mask=ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr,
                        act_ptr, R, H, I, TOP_K, stride_xn, stride_ws, stride_wn, stride_ss, stride_ar,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr,
                        SCAN_R: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
        slot, routes, ok, rn, n_ok = _program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, I,
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
        _store_act(acc_gate, acc_up, act_ptr, routes, ok, rn, n_ok, stride_ar)

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, scale_ptr, rw_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr,
                     y_ptr, R, H, I, stride_ar, stride_ws, stride_wn, stride_ss, stride_yr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr,
                     SCAN_R: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
        slot, routes, ok, rn, n_ok = _program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, H,
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
        _store_routed(acc, y_ptr, rw_ptr, routes, ok, rn, n_ok, stride_yr)


    # --- 4-bit codes (Int4Experts) ---------------------------------------------------------------------------

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
        slot, routes, ok, rn, n_ok = _program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, I,
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
        _store_act(acc_gate, acc_up, act_ptr, routes, ok, rn, n_ok, stride_ar)

    @triton.jit
    def _down_int4_kernel(act_ptr, q_ptr, s_ptr, o_ptr, rw_ptr, slots_ptr, sorted_slots_ptr, sorted_routes_ptr,
                          starts_ptr, y_ptr, R, H, KW, stride_ar, stride_qs, stride_qn, stride_ss, stride_sn,
                          stride_yr, GROUP: tl.constexpr, RUN: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SCAN: tl.constexpr, SCAN_R: tl.constexpr,
                          PRECISION: tl.constexpr):
        slot, routes, ok, rn, n_ok = _program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, H,
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
        _store_routed(acc, y_ptr, rw_ptr, routes, ok, rn, n_ok, stride_yr)


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
    y = out.view(R, H)
    if isinstance(quant, Int4Experts):
        _launch_int4(x, gate_up, down, w_flat, route_args, act, y, k, launch, quant, blocks_of, common)
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


def int4_block_kw(launch: MoELaunch) -> int:
    """Words a 4-bit step reads along K: the launch's BLOCK_K inputs, at least 16 words (a tensor-core dot's K
    of 16 per slot)."""
    return max(16, launch.block_k // CODES_PER_WORD)


def _launch_int4(x, gate_up, down, w_flat, route_args, act, y, k, launch, quant: Int4Experts, blocks_of, common
                 ) -> None:
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
