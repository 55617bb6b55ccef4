"""ExpertPool: one sparse layer's expert slots on the device, its store (host or peer) and its slot policy.

`gate_up [slots + 1, 2I, H]` and `down [slots + 1, H, I]` on the device, whose last row is a zero *miss slot*,
and `table [E]` (expert -> its slot, or the miss slot); the store holds every expert once (`[E, 2I, H]`,
`[E, H, I]`, pinned when it is host memory for a CUDA device), or, for a synthetic source, is a store shared by
every layer whose row `store_rows[e]` is expert e. The cache (engine.exec.experts.cache) decides what moves.

Experts stored as FP8 with one scale per output channel (`--quantize fp8`, or a checkpoint whose experts are
per-channel FP8) stay FP8 in the store and the slots, half the bytes of bf16 to hold and to copy, with their
scales beside them (`scales`: gate_up [slots + 1, 2I], down [slots + 1, H], fp32; engine.model.moe_kernels applies
them); other quantized experts are held dequantized, in the router's (the activations') dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.exec.experts.trace import SlotPolicy
from engine.model.moe import SparseMoE, dense_weight
from engine.model.moe_kernels import routed_experts
from engine.model.quant.linear import Fp8Linear

Scales = tuple[torch.Tensor, torch.Tensor]  # (gate_up [*, 2I], down [*, H]) fp32, one per output channel


def _fp8_channels(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 weight [N, K], scale [N]) of an FP8 projection with one scale per output channel, else None."""
    if isinstance(linear, Fp8Linear) and linear.block_n == 1 and linear.block_k >= linear.in_features:
        return linear.weight, linear.weight_scale[:, 0]
    return None


def fp8_experts(block: SparseMoE) -> bool:
    """Whether a block's experts stay FP8 in the cache: a synthetic FP8 store, or every projection of every
    expert per-channel FP8."""
    if block.expert_store is not None:
        return block.expert_scales is not None
    return bool(len(block.experts)) and all(_fp8_channels(p) is not None for e in block.experts
                                            for p in (e.gate_proj, e.up_proj, e.down_proj))


def expert_bytes(block: SparseMoE) -> int:
    """Bytes of one expert as the cache holds it (its FP8 scales included)."""
    H, I = block.gate.in_features, block.intermediate_size
    if fp8_experts(block):
        return 3 * H * I + 4 * (2 * I + H)
    return 3 * H * I * block.gate.weight.element_size()


def _on_store(t: torch.Tensor, device: torch.device, pin: bool, moved: dict[int, torch.Tensor]) -> torch.Tensor:
    """A shared store tensor where the store lives (pinned when asked): as it is when it is there already, and
    moved once for all the layers that share it (`moved`: by the source's address)."""
    if t.device == device and (not pin or t.is_pinned()):
        return t
    key = t.data_ptr()
    if key not in moved:
        moved[key] = t.to(device).pin_memory() if pin else t.to(device)
    return moved[key]


class ExpertPool:
    """One sparse layer's slots on the device, its store (host or peer) and its slot policy."""

    def __init__(self, block: SparseMoE, device: torch.device, store_device: torch.device, pin: bool,
                 moved: dict[int, torch.Tensor] | None = None) -> None:
        E, I = block.num_experts, block.intermediate_size
        # quantized experts are held dequantized, in the router's (the activations') dtype
        H, dtype = block.gate.in_features, block.gate.weight.dtype
        self.num_experts = E
        self.store_rows = list(range(E))  # expert -> its row in the store
        self.store_scales: Scales | None = None  # an FP8 store's scales
        moved = moved if moved is not None else {}
        if block.expert_store is not None:
            # a synthetic source's shared store (engine.model.synthetic): every layer's experts are rows of it,
            # already generated where they live (pinned host memory, or a device); moved once when elsewhere
            self.store_gate_up, self.store_down = (_on_store(t, store_device, pin, moved) for t in block.expert_store)
            self.store_rows = list(block.store_rows)
            block.expert_store = (self.store_gate_up, self.store_down)
            if block.expert_scales is not None:
                self.store_scales = tuple(_on_store(t, store_device, pin, moved) for t in block.expert_scales)
                block.expert_scales = self.store_scales
        elif fp8_experts(block):
            fp8 = torch.float8_e4m3fn
            self.store_gate_up = torch.empty(E, 2 * I, H, dtype=fp8, device=store_device, pin_memory=pin)
            self.store_down = torch.empty(E, H, I, dtype=fp8, device=store_device, pin_memory=pin)
            self.store_scales = (torch.empty(E, 2 * I, device=store_device, pin_memory=pin),
                                 torch.empty(E, H, device=store_device, pin_memory=pin))
            with torch.no_grad():
                for e, expert in enumerate(block.experts):
                    for rows, proj in ((slice(0, I), expert.gate_proj), (slice(I, 2 * I), expert.up_proj)):
                        weight, scale = _fp8_channels(proj)
                        self.store_gate_up[e, rows].copy_(weight)
                        self.store_scales[0][e, rows].copy_(scale)
                    weight, scale = _fp8_channels(expert.down_proj)
                    self.store_down[e].copy_(weight)
                    self.store_scales[1][e].copy_(scale)
        else:
            self.store_gate_up = torch.empty(E, 2 * I, H, dtype=dtype, device=store_device, pin_memory=pin)
            self.store_down = torch.empty(E, H, I, dtype=dtype, device=store_device, pin_memory=pin)
            with torch.no_grad():
                for e, expert in enumerate(block.experts):
                    self.store_gate_up[e, :I].copy_(dense_weight(expert.gate_proj, dtype))
                    self.store_gate_up[e, I:].copy_(dense_weight(expert.up_proj, dtype))
                    self.store_down[e].copy_(dense_weight(expert.down_proj, dtype))
        self.device = device
        self.policy = SlotPolicy(0)
        self.gate_up = self.down = self.table = torch.empty(0)
        self.scales: Scales | None = None  # the slots' FP8 scales (an FP8 store's)
        self._table_host = [0] * E
        # a copy into this pool's slots not waited for yet (cold `cpu` admissions, `prefetch`): the pool's next
        # reader waits for it (engine.exec.experts.cold)
        self.pending: torch.cuda.Event | None = None

    @property
    def slots(self) -> int:
        return self.policy.slots

    def allocate(self, slots: int, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """(Re)allocate `slots` slots plus the miss slot, keeping the experts the policy ranks highest."""
        old_gate_up, old_down, old_scales = self.gate_up, self.down, self.scales
        kept = self.policy.resize(slots)
        I2, H = self.store_gate_up.shape[1:]
        E = self.num_experts
        self.gate_up = self.down = None  # type: ignore[assignment]  # the old pool may go before the new one is made
        gate_up = torch.empty(slots + 1, I2, H, dtype=self.store_gate_up.dtype, device=self.device)
        down = torch.empty(slots + 1, H, I2 // 2, dtype=self.store_down.dtype, device=self.device)
        gate_up[slots].zero_()
        down[slots].zero_()
        scales = None if self.store_scales is None else (
            torch.zeros(slots + 1, I2, device=self.device), torch.zeros(slots + 1, H, device=self.device))
        for e, old_slot in kept.items():
            new_slot = self.policy.where[e]
            copy(gate_up[new_slot], old_gate_up[old_slot])
            copy(down[new_slot], old_down[old_slot])
            if scales is not None:
                copy(scales[0][new_slot], old_scales[0][old_slot])
                copy(scales[1][new_slot], old_scales[1][old_slot])
        self.gate_up, self.down, self.scales = gate_up, down, scales
        self._table_host = [slots] * E
        for e, s in self.policy.where.items():
            self._table_host[e] = s
        self.table = torch.tensor(self._table_host, dtype=torch.long, device=self.device)

    def set_table(self, changes: list[tuple[int, int]]) -> None:
        """Point `expert -> slot` for each change (slot = self.slots: not resident)."""
        if not changes:
            return
        for e, s in changes:
            self._table_host[e] = s
        idx = torch.tensor([e for e, _ in changes], dtype=torch.long)
        val = torch.tensor([s for _, s in changes], dtype=torch.long)
        self.table.index_copy_(0, idx.to(self.device), val.to(self.device))

    def load(self, slot: int, e: int, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Copy expert e from the store into `slot` (its scales too, for an FP8 store)."""
        row = self.store_rows[e]
        copy(self.gate_up[slot], self.store_gate_up[row])
        copy(self.down[slot], self.store_down[row])
        if self.scales is not None:
            copy(self.scales[0][slot], self.store_scales[0][row])
            copy(self.scales[1][slot], self.store_scales[1][row])

    def host_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) where the store is, in `dtype` (an FP8 one dequantized)."""
        row = self.store_rows[e]
        gate_up, down = self.store_gate_up[row], self.store_down[row]
        if self.store_scales is None:
            return gate_up, down
        return ((gate_up.to(torch.float32) * self.store_scales[0][row][:, None]).to(dtype),
                (down.to(torch.float32) * self.store_scales[1][row][:, None]).to(dtype))

    def run_resident(self, y: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     rows: torch.Tensor | None, experts: list[int] | None) -> None:
        """y[n, j] = weights[n, j] * expert(x[n]) for the routes to `experts` (None: every route; all resident),
        through this pool's slots in place (engine.model.moe_kernels); padding rows are left out."""
        if experts is not None and not experts:
            return
        slots = self.table[ids]  # [N, k]
        if experts is not None:
            slots = torch.where(torch.isin(ids, torch.tensor(experts, device=ids.device)), slots, -1)
        if rows is not None:
            slots = torch.where(rows[:, None], slots, -1)
        routed_experts(x, self.gate_up, self.down, slots, weights, out=y, scales=self.scales)
