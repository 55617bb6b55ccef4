"""The VRAM budget (weights + KV + graphs + adaptive tier + reserve per device) and the adaptive tier.

The adaptive tier is the prefix cache's memory: KV blocks (all layers of `block_tokens` tokens) keyed by the
PrefixIndex's block ids. On a GPU it takes what is left after weights, KV, graphs and the reserve, up front
(so the engine runs with VRAM near-full by design, as the seed report's expert cache did), and gives memory
back through ONE call, `release(mib, reason)`, used by admission and by the graph cache's out-of-memory path.
On CPU it holds host tensors within a fixed budget, allocated as blocks are filled.

Both directions publish a TierEvent. The index stays the single owner of block ids: the tier only resizes
the index's pool and frees the tensors of the ids the index released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.errors import ConfigError
from engine.exec.kv_cache import SlotKVCache
from engine.core.prefix_index import BlockRef, PrefixIndex
from engine.telemetry import EventBus, TierEvent, VramEvent

MIB = float(1 << 20)
# When the tier regrows: only for room worth at least this many blocks (avoids grow/shrink flapping).
_GROW_MIN_BLOCKS = 4
# Upper bound on tier blocks: a tiny model on a large GPU would otherwise mean millions of block tensors. High
# enough that the tier still fills a 141 GiB card with the embedded tiny model's small blocks, so VRAM is
# near-full by design there too (docs/VRAM.md).
MAX_TIER_BLOCKS = 1 << 18
# A growing preallocated tier measures the room left after every this many MiB of blocks.
_ROOM_CHECK_MIB = 64.0
# CPU runs: the tier's budget when none is configured (capped by a fraction of available RAM).
CPU_TIER_DEFAULT_MIB = 512.0
_CPU_TIER_RAM_FRACTION = 0.125


def device_memory_mib(device: torch.device) -> tuple[float, float]:
    """(total, free) MiB of a CUDA device, or of host RAM (MemTotal, MemAvailable) for the CPU."""
    if device.type == "cuda":
        free_b, total_b = torch.cuda.mem_get_info(device)
        # Memory torch holds cached but unused is free to us, not to other processes.
        cached_b = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return total_b / MIB, (free_b + cached_b) / MIB
    total = avail = 0.0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    total = float(line.split()[1]) / 1024
                elif line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) / 1024
    except OSError:
        pass
    return total, avail


def check_kv_fits(kv_mib: float, weights_mib: float, reserve_mib: float, free_mib: float, what: str, value: object,
                  needs: str = "the KV cache needs",
                  hint: str = "lower --context or --batch, use --kv int8, or lower --vram-reserve-mib") -> None:
    """Raise ConfigError naming the numbers when the KV cache cannot fit next to the reserve."""
    available = free_mib - reserve_mib
    if kv_mib > available:
        raise ConfigError(
            what, value,
            f"{needs} {kv_mib:.0f} MiB but only {available:.0f} MiB are available "
            f"({free_mib:.0f} MiB free after {weights_mib:.0f} MiB of weights, minus the "
            f"{reserve_mib:.0f} MiB reserve); {hint}",
        )


class AdaptiveTier:
    """Prefix-cache KV blocks in device (or host) memory, sized by a budget that can move both ways."""

    def __init__(self, index: PrefixIndex, kv: SlotKVCache, bus: EventBus, device: torch.device,
                 budget_mib: float, preallocate: bool, room_mib: Callable[[], float] | None = None,
                 room_check_mib: float = _ROOM_CHECK_MIB) -> None:
        self.index = index
        # How much more memory the tier may take right now, measured (on CUDA: the driver's free memory minus
        # what must stay free). A preallocating tier checks it while it grows: a block's bytes understate what
        # the allocator really takes for it (small blocks share 2 MiB segments with slack: +11 % for the
        # embedded tiny model), and a budget computed from block bytes alone once left the reserve at 0 MiB.
        self.room_mib = room_mib
        self.room_check_mib = room_check_mib
        self.kv = kv
        self.bus = bus
        self.device = device
        self.preallocate = preallocate
        self.block_tokens = index.block_tokens
        g = kv.geometry
        self._data_shape = (g.num_layers, 2, g.num_kv_heads, self.block_tokens, g.head_dim)
        self._data_dtype = kv.k[0].dtype
        self.block_mib = g.bytes_per_token(kv.storage, kv.compute_dtype) * self.block_tokens / MIB
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.filled_blocks = 0
        self.copied_in_blocks = 0
        self._resize_to(self.blocks_for(budget_mib), "start")

    # --- queries -------------------------------------------------------------------------------------------

    def blocks_for(self, mib: float) -> int:
        return min(MAX_TIER_BLOCKS, max(0, int(mib // self.block_mib))) if self.block_mib > 0 else 0

    @property
    def capacity_blocks(self) -> int:
        return self.index.capacity_blocks

    @property
    def mib(self) -> float:
        """Memory the tier holds now (allocated blocks)."""
        return len(self._blocks) * self.block_mib

    @property
    def capacity_mib(self) -> float:
        return self.capacity_blocks * self.block_mib

    def snapshot(self) -> dict:
        stats = self.index.stats()
        return {
            "device": str(self.device), "mib": round(self.mib, 2), "capacity_mib": round(self.capacity_mib, 2),
            "block_tokens": self.block_tokens, "block_mib": round(self.block_mib, 4),
            "capacity_blocks": stats.capacity_blocks, "used_blocks": stats.used_blocks,
            "pinned_blocks": stats.pinned_blocks, "hit_blocks": stats.hit_blocks, "miss_blocks": stats.miss_blocks,
            "evicted_blocks": stats.evicted_blocks, "preallocated": self.preallocate,
        }

    # --- block copies (the runner calls these) -----------------------------------------------------------

    def fill(self, refs: list[BlockRef], slot: int) -> list[int]:
        """Copy slot KV into the tier blocks `refs` name; returns the ids that could not be filled."""
        failed: list[int] = []
        for ref in refs:
            start = ref.index * self.block_tokens
            try:
                data, scales = self.kv.read_span(slot, start, start + self.block_tokens)
                dst = self._block(ref.block_id)
                dst[0].copy_(data, non_blocking=True)
                if scales is not None and dst[1] is not None:
                    dst[1].copy_(scales, non_blocking=True)
                self.filled_blocks += 1
            except torch.OutOfMemoryError:
                failed.append(ref.block_id)
        return failed

    def load(self, refs: list[BlockRef], slot: int) -> None:
        """Copy cached blocks into a slot at their prompt positions (an admission that reuses a prefix)."""
        for ref in refs:
            data, scales = self._blocks[ref.block_id]
            self.kv.write_span(slot, ref.index * self.block_tokens, data, scales)
            self.copied_in_blocks += 1

    # --- size changes ----------------------------------------------------------------------------------------

    def release(self, mib: float, reason: str) -> float:
        """Give back at least `mib` MiB of held memory if the tier has it; returns the MiB actually freed.

        A preallocated (GPU) tier lowers its capacity: free blocks go first, then least recently used unpinned
        ones, and the memory returns to the device (empty_cache); it regrows when `VramBudget.rebalance` finds
        room again. A host tier evicts least recently used unpinned blocks and keeps its budget. Pinned blocks
        (being copied into a slot this step) always stay.
        """
        if mib <= 0 or self.block_mib <= 0:
            return 0.0
        before = self.mib
        want_blocks = math.ceil(mib / self.block_mib)
        if self.preallocate:
            self._resize_to(max(0, self.capacity_blocks - want_blocks), reason)
        else:
            for block_id in self.index.evict(want_blocks):
                self._blocks.pop(block_id, None)
            if self.mib < before:
                self._publish("shrink", before - self.mib, reason)
        freed = before - self.mib
        if freed > 0 and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def set_budget(self, mib: float, reason: str) -> None:
        """Grow or shrink the tier's capacity to `mib` (whole blocks)."""
        self._resize_to(self.blocks_for(mib), reason)

    def _resize_to(self, blocks: int, reason: str) -> None:
        before_cap = self.capacity_blocks
        before_mib = self.mib
        result = self.index.resize(blocks)
        for block_id in result.released_block_ids:
            self._blocks.pop(block_id, None)
        if self.preallocate and result.added_block_ids:
            if self._allocate(result.added_block_ids) < len(result.added_block_ids):
                # The room ran out while growing: keep what was allocated, hand the rest of the ids back.
                self.index.resize(len(self._blocks))
        after_cap = self.capacity_blocks
        if after_cap == before_cap and self.mib == before_mib:
            return
        if self.preallocate:
            delta = self.mib - before_mib
        else:
            delta = (after_cap - before_cap) * self.block_mib
        self._publish("grow" if delta > 0 else "shrink", abs(delta), reason)

    def _allocate(self, block_ids: list[int]) -> int:
        """Back `block_ids` with memory in order, checking the measured room every `room_check_mib`; returns how
        many were allocated (fewer when the room or the device ran out)."""
        group = max(1, int(self.room_check_mib // self.block_mib)) if self.block_mib > 0 else len(block_ids)
        for done, block_id in enumerate(block_ids):
            if self.room_mib is not None and done % group == 0:
                if self.room_mib() < min(group, len(block_ids) - done) * self.block_mib:
                    return done
            try:
                self._block(block_id)
            except torch.OutOfMemoryError:
                return done
        return len(block_ids)

    def _publish(self, action: str, mib: float, reason: str) -> None:
        """TierEvent: `mib` changed by, `total_mib` the budget afterwards (preallocated: the memory held)."""
        self.bus.publish(TierEvent(action=action, mib=round(mib, 4), total_mib=round(self.capacity_mib, 4),
                                   reason=reason, device=str(self.device)))

    def _block(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        block = self._blocks.get(block_id)
        if block is None:
            data = torch.empty(self._data_shape, dtype=self._data_dtype, device=self.device)
            scales = (torch.empty(self._data_shape[:-1], dtype=torch.float32, device=self.device)
                      if self.kv.storage == "int8" else None)
            block = self._blocks[block_id] = (data, scales)
        return block


@dataclass
class VramBudget:
    """One device's books: what each part holds, the reserve, and what is free. Feeds VramEvent and the tier."""

    device: torch.device
    reserve_mib: float
    weights_mib: float
    kv_mib: float
    tier: AdaptiveTier | None = None
    graphs_mib: float = 0.0
    # The MoE expert cache (engine.exec.expert_cache.ExpertCache) when the model has one: a second claimant
    # that shrinks on request (after the tier) and regrows towards its budget (before the tier).
    experts: Any = None
    # Learned on top of the reserve: memory a step needed that the reserve did not cover (an eager
    # out-of-memory the tier had to answer). Kept out of the tier so the next such step does not OOM again.
    headroom_mib: float = 0.0
    # --kv-resident paging (engine.exec.kv_paging.KVPaging): its host-held KV is reported beside the books.
    kv_paging: Any = None

    def breakdown(self) -> VramEvent:
        total, free = device_memory_mib(self.device)
        return VramEvent(device=str(self.device), total_mib=round(total, 1), weights_mib=round(self.weights_mib, 1),
                         kv_mib=round(self.kv_mib, 1), graphs_mib=round(self.graphs_mib, 1),
                         tier_mib=round(self.tier.mib if self.tier else 0.0, 1),
                         reserve_mib=round(self.reserve_mib, 1), free_mib=round(free, 1),
                         experts_mib=round(self.experts.mib if self.experts is not None else 0.0, 1),
                         host_kv_mib=round(self.kv_paging.host_mib if self.kv_paging is not None else 0.0, 1))

    def driver_room_mib(self) -> float:
        """What a preallocating tier may still take: the driver's free memory (not counting memory torch keeps
        cached, which fragments can leave unusable) minus the reserve and the learned headroom."""
        free_b, _ = torch.cuda.mem_get_info(self.device)
        return free_b / MIB - self.reserve_mib - self.headroom_mib

    def tier_room_mib(self) -> float:
        """How far the tier may grow (positive) or must shrink (negative) to keep the reserve free (CUDA)."""
        _, free = device_memory_mib(self.device)
        return free - self.reserve_mib - self.headroom_mib

    def make_room(self, mib: float, reason: str) -> float:
        """Free `mib` from the tier for a step that ran out of memory, and keep that much free from now on
        (bounded by 4x the reserve) so the tier does not regrow into it. Returns the MiB freed."""
        freed = self.tier.release(mib, reason) if self.tier is not None else 0.0
        if freed < mib and self.experts is not None:
            freed += self.experts.release(mib - freed, reason)
        self.headroom_mib = min(self.headroom_mib + freed, 4 * max(self.reserve_mib, 256.0))
        return freed

    def rebalance(self, reason: str = "rebalance") -> None:
        """On CUDA: shrink the tier when the reserve is not free, grow it into room worth a few blocks."""
        if self.device.type != "cuda":
            return
        if self.experts is not None and self.experts.slots < self.experts.target_slots:
            room = self.tier_room_mib()
            if room > 0:
                self.experts.grow(min(room, self.driver_room_mib()), reason)
        tier = self.tier
        if tier is None:
            return
        room = self.tier_room_mib()
        if room < 0:
            tier.release(-room, reason)
            return
        if room >= _GROW_MIN_BLOCKS * tier.block_mib and tier.room_mib is not None:
            # Memory torch keeps cached counts as free above, but a block can only grow into what the driver
            # has; asking first spares a resize of the whole block pool every second that would allocate nothing.
            room = min(room, tier.room_mib())
        if room >= _GROW_MIN_BLOCKS * tier.block_mib:
            tier.set_budget(tier.capacity_mib + room, reason)

    def set_expert_budget(self, mib: float, reason: str) -> None:
        """Retune the expert cache live: a smaller budget gives its memory back at once; a larger one grows only
        into the room the books leave, like the tier (CPU has no books to measure: it grows to the budget)."""
        self.experts.retarget(mib, reason)
        if self.device.type == "cuda":
            self.rebalance(reason)
        else:
            self.experts.grow(self.experts.mib_for(self.experts.target_slots), reason)

    def set_reserve(self, mib: float) -> None:
        """Retune the reserve live; the tier shrinks at once when the new reserve is not free."""
        self.reserve_mib = float(mib)
        self.rebalance(f"vram reserve set to {mib} MiB")
