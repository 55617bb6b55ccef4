"""ExpertPool: one sparse layer's expert slots on the device, its store (host or peer) and its slot policy.

`gate_up [slots + 1, 2I, H]` and `down [slots + 1, H, I]` on the device, whose last row is a zero *miss slot*,
and `table [E]` (expert -> its slot, or the miss slot); the store holds every expert once (`[E, 2I, H]`,
`[E, H, I]`, pinned when it is host memory for a CUDA device), or, for a synthetic source, is a store shared by
every layer whose row `store_rows[e]` is expert e. The cache (engine.exec.experts.cache) decides what moves.

Quantized experts stay quantized in the store and the slots, with their scales beside them (`store_quant`,
`quant`: an engine.model.moe_quant structure whose tensors have the same first dimension as the weights, the
miss slot's zero; engine.model.moe_kernels reads them in place):
- FP8 with one scale per output channel (`--quantize fp8`, or a checkpoint whose experts are per-channel FP8):
  e4m3 weights, half the bytes of bf16 to hold and to copy (`fp8_experts`);
- 4-bit codes with a scale and offset per group (`--quantize int4`, or a checkpoint whose experts are 4-bit
  group-quantized, as AWQ, GPTQ without act-order, compressed-tensors' W4A16 and GGUF's Q4_K load): int32 words
  in engine.model.quant.linear.kernel_pack's layout, `gate_up [*, 2I, H / 8]`, `down [*, H, I / 8]`, about a
  quarter of bf16's bytes with the scales (`int4_experts`).
Other quantized experts (8-bit codes, 128 x 128 FP8 blocks, GPTQ's act-order) are held dequantized, in the
router's (the activations') dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.exec.experts.trace import SlotPolicy
from engine.model.moe import SparseMoE, dense_weight
from engine.model.moe_kernels import routed_experts
from engine.model.moe_quant import CODES_PER_WORD, ExpertQuant, Fp8Experts, Int4Experts
from engine.model.quant.linear import Fp8Linear, IntGroupLinear


def _fp8_channels(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 weight [N, K], scale [N]) of an FP8 projection with one scale per output channel, else None."""
    if isinstance(linear, Fp8Linear) and linear.block_n == 1 and linear.block_k >= linear.in_features:
        return linear.weight, linear.weight_scale[:, 0]
    return None


def _int4_layout(block: SparseMoE) -> tuple[int, int, int, int, torch.dtype] | None:
    """(gate_up group, down group, gate_up run, down run, scale dtype) when every projection of every expert is a
    4-bit IntGroupLinear without act-order and the experts share one layout (gate and up alike), else None."""
    if not len(block.experts):
        return None
    layouts = set()
    for e in block.experts:
        projs = (e.gate_proj, e.up_proj, e.down_proj)
        if not all(isinstance(p, IntGroupLinear) and p.bits == 4 and p.perm is None and p.bias is None
                   and p.scales.dtype == p.offsets.dtype for p in projs):
            return None
        g, u, d = projs
        if (g.group_size, g.run) != (u.group_size, u.run):
            return None
        layouts.add((g.group_size, d.group_size, g.run, d.run, g.scales.dtype))
    return layouts.pop() if len(layouts) == 1 else None


def fp8_experts(block: SparseMoE) -> bool:
    """Whether a block's experts stay FP8 in the cache: a synthetic FP8 store, or every projection of every
    expert per-channel FP8."""
    if block.expert_store is not None:
        return isinstance(block.expert_quant, Fp8Experts)
    return bool(len(block.experts)) and all(_fp8_channels(p) is not None for e in block.experts
                                            for p in (e.gate_proj, e.up_proj, e.down_proj))


def int4_experts(block: SparseMoE) -> bool:
    """Whether a block's experts stay 4-bit in the cache: a synthetic 4-bit store, or every projection of every
    expert a 4-bit group-quantized layer of one layout (act-order ones are not: their inputs are permuted)."""
    if block.expert_store is not None:
        return isinstance(block.expert_quant, Int4Experts)
    return _int4_layout(block) is not None


def expert_bytes(block: SparseMoE) -> int:
    """Bytes of one expert as the cache holds it (its scales and offsets included)."""
    H, I = block.gate.in_features, block.intermediate_size
    if fp8_experts(block):
        return 3 * H * I + 4 * (2 * I + H)
    if int4_experts(block):
        if block.expert_store is not None:
            quant = block.expert_quant
            gu_group, dn_group, elem = quant.gate_up_group, quant.down_group, quant.gate_up_scales.element_size()
        else:
            gu_group, dn_group, _, _, dtype = _int4_layout(block)
            elem = torch.empty(0, dtype=dtype).element_size()
        return int4_expert_bytes(H, I, gu_group, dn_group, elem)
    return 3 * H * I * block.gate.weight.element_size()


def int4_expert_bytes(H: int, I: int, gate_up_group: int, down_group: int, scale_bytes: int) -> int:
    """One 4-bit expert's bytes: half a byte a weight, and a scale and an offset a group."""
    return 3 * H * I // 2 + 2 * scale_bytes * (2 * I * (H // gate_up_group) + H * (I // down_group))


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
        self.store_quant: ExpertQuant | None = None  # a quantized store's scales (engine.model.moe_quant)
        moved = moved if moved is not None else {}
        if block.expert_store is not None:
            # a synthetic source's shared store (engine.model.synthetic): every layer's experts are rows of it,
            # already generated where they live (pinned host memory, or a device); moved once when elsewhere
            self.store_gate_up, self.store_down = (_on_store(t, store_device, pin, moved) for t in block.expert_store)
            self.store_rows = list(block.store_rows)
            block.expert_store = (self.store_gate_up, self.store_down)
            if block.expert_quant is not None:
                self.store_quant = block.expert_quant.rebuilt(
                    tuple(_on_store(t, store_device, pin, moved) for t in block.expert_quant.tensors()))
                block.expert_quant = self.store_quant
        elif fp8_experts(block):
            self._store_fp8(block, store_device, pin)
        elif int4_experts(block):
            self._store_int4(block, store_device, pin)
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
        self.quant: ExpertQuant | None = None  # the slots' scales (a quantized store's format)
        self._table_host = [0] * E
        # a copy into this pool's slots not waited for yet (cold `cpu` admissions, `prefetch`): the pool's next
        # reader waits for it (engine.exec.experts.cold)
        self.pending: torch.cuda.Event | None = None

    def _store_fp8(self, block: SparseMoE, store_device: torch.device, pin: bool) -> None:
        E, I, H = self.num_experts, block.intermediate_size, block.gate.in_features
        fp8 = torch.float8_e4m3fn
        self.store_gate_up = torch.empty(E, 2 * I, H, dtype=fp8, device=store_device, pin_memory=pin)
        self.store_down = torch.empty(E, H, I, dtype=fp8, device=store_device, pin_memory=pin)
        quant = Fp8Experts(torch.empty(E, 2 * I, device=store_device, pin_memory=pin),
                           torch.empty(E, H, device=store_device, pin_memory=pin))
        with torch.no_grad():
            for e, expert in enumerate(block.experts):
                for rows, proj in ((slice(0, I), expert.gate_proj), (slice(I, 2 * I), expert.up_proj)):
                    weight, scale = _fp8_channels(proj)
                    self.store_gate_up[e, rows].copy_(weight)
                    quant.gate_up_scale[e, rows].copy_(scale)
                weight, scale = _fp8_channels(expert.down_proj)
                self.store_down[e].copy_(weight)
                quant.down_scale[e].copy_(scale)
        self.store_quant = quant

    def _store_int4(self, block: SparseMoE, store_device: torch.device, pin: bool) -> None:
        """Each expert's packed codes, scales and offsets as its IntGroupLinear layers hold them (gate rows first)."""
        E, I, H = self.num_experts, block.intermediate_size, block.gate.in_features
        gu_group, dn_group, gu_run, dn_run, sdtype = _int4_layout(block)

        def empty(*shape: int, dtype: torch.dtype = sdtype) -> torch.Tensor:
            return torch.empty(E, *shape, dtype=dtype, device=store_device, pin_memory=pin)

        self.store_gate_up = empty(2 * I, H // CODES_PER_WORD, dtype=torch.int32)
        self.store_down = empty(H, I // CODES_PER_WORD, dtype=torch.int32)
        quant = Int4Experts(empty(2 * I, H // gu_group), empty(2 * I, H // gu_group), empty(H, I // dn_group),
                            empty(H, I // dn_group), gu_group, dn_group, gu_run, dn_run)
        with torch.no_grad():
            for e, expert in enumerate(block.experts):
                for rows, proj in ((slice(0, I), expert.gate_proj), (slice(I, 2 * I), expert.up_proj)):
                    self.store_gate_up[e, rows].copy_(proj.qweight)
                    quant.gate_up_scales[e, rows].copy_(proj.scales)
                    quant.gate_up_offsets[e, rows].copy_(proj.offsets)
                self.store_down[e].copy_(expert.down_proj.qweight)
                quant.down_scales[e].copy_(expert.down_proj.scales)
                quant.down_offsets[e].copy_(expert.down_proj.offsets)
        self.store_quant = quant

    @property
    def slots(self) -> int:
        return self.policy.slots

    def allocate(self, slots: int, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """(Re)allocate `slots` slots plus the miss slot, keeping the experts the policy ranks highest. The new
        tensors are allocated before anything changes: a growth that runs out of memory leaves the layer as it
        was. A shrink with no room for its new tensors beside the old ones (it is asked for when memory ran out)
        frees the old ones first and copies the experts it keeps from the store instead."""
        try:
            new = self._new_tensors(slots)
        except torch.OutOfMemoryError:
            if slots >= self.slots:
                raise
            kept = self.policy.resize(slots)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy into the old tensors still in flight
            self.gate_up = self.down = self.quant = None  # type: ignore[assignment]  # freed before the new ones
            self.gate_up, self.down, self.quant = self._new_tensors(slots)
            for e in kept:
                self.load(self.policy.where[e], e, copy)
        else:
            old_gate_up, old_down, old_quant = self.gate_up, self.down, self.quant
            kept = self.policy.resize(slots)
            self.gate_up, self.down, self.quant = new
            for e, old_slot in kept.items():
                new_slot = self.policy.where[e]
                copy(self.gate_up[new_slot], old_gate_up[old_slot])
                copy(self.down[new_slot], old_down[old_slot])
                if self.quant is not None:
                    for t, old in zip(self.quant.tensors(), old_quant.tensors()):
                        copy(t[new_slot], old[old_slot])
        self._table_host = [slots] * self.num_experts
        for e, s in self.policy.where.items():
            self._table_host[e] = s
        self.table = torch.tensor(self._table_host, dtype=torch.long, device=self.device)

    def _new_tensors(self, slots: int) -> tuple[torch.Tensor, torch.Tensor, ExpertQuant | None]:
        """Device tensors of `slots` slots in the store's layout (a 4-bit store's last dimension is words), the miss
        slot all zeros, scales too."""
        gate_up = empty((slots + 1, *self.store_gate_up.shape[1:]), self.store_gate_up.dtype, self.device)
        down = empty((slots + 1, *self.store_down.shape[1:]), self.store_down.dtype, self.device)
        gate_up[slots].zero_()
        down[slots].zero_()
        quant = None if self.store_quant is None else self.store_quant.rebuilt(
            tuple(empty((slots + 1, *t.shape[1:]), t.dtype, self.device).zero_() for t in self.store_quant.tensors()))
        return gate_up, down, quant

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
        """Copy expert e from the store into `slot` (its scales and offsets too, for a quantized store)."""
        row = self.store_rows[e]
        copy(self.gate_up[slot], self.store_gate_up[row])
        copy(self.down[slot], self.store_down[row])
        if self.quant is not None:
            for dst, src in zip(self.quant.tensors(), self.store_quant.tensors()):
                copy(dst[slot], src[row])

    def host_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) where the store is, in `dtype` (a quantized one dequantized)."""
        row = self.store_rows[e]
        gate_up, down = self.store_gate_up[row], self.store_down[row]
        if self.store_quant is None:
            return gate_up, down
        return self.store_quant.at(row).dequantize(gate_up, down, dtype)

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
        routed_experts(x, self.gate_up, self.down, slots, weights, out=y, quant=self.quant)


def empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An expert pool's device tensor (one seam for every allocation of a resize: tests fail one on purpose)."""
    return torch.empty(shape, dtype=dtype, device=device)
