"""ExpertPool: one sparse layer's expert slots on the device, its store (host or peer) and its slot policy.

`gate_up [slots + 1, 2I, H]` and `down [slots + 1, H, I]` on the device, whose last row is a zero *miss slot*,
and `table [E]` (expert -> its slot, or the miss slot); the store holds every expert once (`[E, 2I, H]`,
`[E, H, I]`, pinned when it is host memory for a CUDA device), or, for a synthetic source, is a store shared by
every layer whose row `store_rows[e]` is expert e. The cache (engine.exec.experts.cache) decides what moves.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.exec.experts.trace import SlotPolicy
from engine.model.moe import SparseMoE, dense_weight


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
        if block.expert_store is not None:
            # a synthetic source's shared store (engine.model.synthetic): every layer's experts are rows of it,
            # already generated where they live (pinned host memory, or a device); moved once when elsewhere
            self.store_gate_up, self.store_down = (_on_store(t, store_device, pin, moved if moved is not None else {})
                                                   for t in block.expert_store)
            self.store_rows = list(block.store_rows)
            block.expert_store = (self.store_gate_up, self.store_down)
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
        self._table_host = [0] * E
        # a copy into this pool's slots not waited for yet (cold `cpu` admissions, `prefetch`): the pool's next
        # reader waits for it (engine.exec.experts.cold)
        self.pending: torch.cuda.Event | None = None

    @property
    def slots(self) -> int:
        return self.policy.slots

    def allocate(self, slots: int, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """(Re)allocate `slots` slots plus the miss slot, keeping the experts the policy ranks highest."""
        old_gate_up, old_down = self.gate_up, self.down
        kept = self.policy.resize(slots)
        I2, H = self.store_gate_up.shape[1:]
        E = self.num_experts
        self.gate_up = self.down = None  # type: ignore[assignment]  # the old pool may go before the new one is made
        gate_up = torch.empty(slots + 1, I2, H, dtype=self.store_gate_up.dtype, device=self.device)
        down = torch.empty(slots + 1, H, I2 // 2, dtype=self.store_down.dtype, device=self.device)
        gate_up[slots].zero_()
        down[slots].zero_()
        for e, old_slot in kept.items():
            new_slot = self.policy.where[e]
            copy(gate_up[new_slot], old_gate_up[old_slot])
            copy(down[new_slot], old_down[old_slot])
        self.gate_up, self.down = gate_up, down
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
