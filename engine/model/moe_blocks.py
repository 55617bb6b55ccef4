"""How a step's routes become blocks of one expert, shared by the fused MoE kernels of every pool format
(engine.model.moe_kernels: 16-bit and FP8 pools; engine.model.moe_kernels_int4: 4-bit pools): the launch shape
(a function of the route count alone, so a route gets the same bits whatever else the step routes), the sorted
layout of many routes, and the Triton device functions every program starts and ends with: its block of routes
and output columns, SiLU x up into the activations, the routing weight into the routes' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it (the torch backend serves then)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# At most this many routes a step (N * k) and the programs find their blocks by scanning the routes; above it a
# sort lays the blocks out (the scan's work grows with the square of the routes).
SCAN_MAX_ROUTES = 256


@dataclass(frozen=True)
class MoELaunch:
    """One step's launch shape: routes per block, column tiles of the two products, K per loop step, warps,
    stages, and whether blocks are found by scanning the routes (few) or by a sort (many). A block of 1 route is
    the GEMV (engine.model.moe_gemv: a program per route, no tensor-core dot)."""

    block_m: int
    gate_up_n: int
    down_n: int
    block_k: int
    num_warps: int
    num_stages: int
    scan: bool

    def __post_init__(self) -> None:
        if self.block_m != 1 and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m={self.block_m}: 1 (the GEMV) or a power of two from 16 (the tensor cores' tile)")
        for name in ("gate_up_n", "down_n", "block_k"):
            value = getattr(self, name)
            least = 2 if self.gemv else 16
            if value < least or value & (value - 1):
                raise ValueError(f"{name}={value}: a power of two, at least {least}"
                                 + ("" if self.gemv else " (the tensor cores' tile)"))

    @property
    def gemv(self) -> bool:
        return self.block_m == 1

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


def default_launch(routes: int, four_bit: bool = False) -> MoELaunch:
    """The launch shape for a step of `routes` routes (a function of the count alone: see the module doc).
    Few routes (a decode or verify step): the weights' bytes bound the step and most routes have an expert to
    themselves, so the GEMV, its narrow column tiles giving every SM a share of the bytes; many: the products are
    compute-bound, so wide blocks reuse each weight tile over many rows. A 4-bit pool's GEMV takes shorter K
    steps and wider down tiles (`four_bit`: its unpacking, not its bytes, bounds it; `bench experts --moe-tune`)."""
    if routes <= SCAN_MAX_ROUTES:
        return MoELaunch(1, 8, 32, 128, 4, 2, scan=True) if four_bit else MoELaunch(1, 8, 16, 256, 4, 2, scan=True)
    return MoELaunch(64, 64, 128, 64, 4, 3, scan=False)




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


# --- the programs' shared device code ---------------------------------------------------------------------------

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
    def block_program(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R, N, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SCAN: tl.constexpr, SCAN_R: tl.constexpr):
        """This program's block (slot, routes, ok: _block_routes) and its output columns (rn, n_ok) of N."""
        slot, routes, ok = _block_routes(slots_ptr, sorted_slots_ptr, sorted_routes_ptr, starts_ptr, R,
                                         tl.program_id(0), BLOCK_M, SCAN, SCAN_R)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return slot, routes, ok, rn, rn < N

    @triton.jit
    def store_act(acc_gate, acc_up, act_ptr, routes, ok, rn, n_ok, stride_ar):
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
    def store_routed(acc, y_ptr, rw_ptr, routes, ok, rn, n_ok, stride_yr):
        """The down product's finished sums, rounded to y's dtype (F.linear's output), times the routing weight."""
        dtype = y_ptr.dtype.element_ty
        routing = tl.load(rw_ptr + routes, mask=ok, other=0.0).to(tl.float32)
        y = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
        tl.store(y_ptr + routes.to(tl.int64)[:, None] * stride_yr + rn[None, :], y, mask=ok[:, None] & n_ok[None, :])
