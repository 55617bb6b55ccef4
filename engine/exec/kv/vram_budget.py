"""One device's VRAM books (weights + KV + graphs + adaptive tier + reserve) and the room they leave.

`VramBudget` feeds VramEvent, shrinks the tier when the reserve is not free and grows it into room worth a few
blocks (`rebalance`); the adaptive tier itself is engine.exec.kv.tier.AdaptiveTier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ConfigError
from engine.telemetry import VramEvent

MIB = float(1 << 20)
# When the tier regrows: only for room worth at least this many blocks (avoids grow/shrink flapping).
_GROW_MIN_BLOCKS = 4


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


@dataclass
class DeviceRoom:
    """What one device keeps free, and the room that leaves. The reserve (the user's, retuned live) and the
    headroom learned on top of it: memory a step needed that the reserve did not cover (an eager out-of-memory
    the tier had to answer), kept out of the tier so the next such step does not run out again. The books
    (VramBudget) change it; the tier, built before the books, measures its growth against it (`driver_room_mib`)."""

    device: torch.device
    reserve_mib: float
    headroom_mib: float = 0.0

    def driver_room_mib(self) -> float:
        """What a preallocating tier may still take: the driver's free memory (not counting memory torch keeps
        cached, which fragments can leave unusable) minus the reserve and the learned headroom."""
        free_b, _ = torch.cuda.mem_get_info(self.device)
        return free_b / MIB - self.reserve_mib - self.headroom_mib

    def tier_room_mib(self) -> float:
        """How far the tier may grow (positive) or must shrink (negative) to keep the reserve free (CUDA)."""
        _, free = device_memory_mib(self.device)
        return free - self.reserve_mib - self.headroom_mib


class VramBudget:
    """One device's books: what each part holds, the reserve, and what is free. Feeds VramEvent and the tier.

    `room`: what the device keeps free (made from `reserve_mib` when not given; given when the tier was built
    against it first). `tier`: the adaptive tier on this device (engine.exec.kv.tier.AdaptiveTier). `experts`: the
    MoE expert cache (engine.exec.experts.cache.ExpertCache) when the model has one: a second claimant that shrinks
    on request (after the tier) and regrows towards its budget (before the tier); `experts_first` (with
    --expert-cache-mib auto: the expert cache fills the card by design and the tier holds only the rest): a step or
    capture that ran out of memory asks the experts first (the claimant that fills the card gives first). `kv_paging`:
    KV by use (engine.exec.kv.paging.KVPaging), whose host-held KV is reported beside the books. `weight_format`:
    how the weights on this device are stored (bf16, fp8 ..., int4 ...)."""

    def __init__(self, device: torch.device, reserve_mib: float | None = None, weights_mib: float = 0.0,
                 kv_mib: float = 0.0, tier: Any = None, graphs_mib: float = 0.0, experts: Any = None,
                 experts_first: bool = False, kv_paging: Any = None, weight_format: str = "",
                 room: DeviceRoom | None = None) -> None:
        if room is None:
            if reserve_mib is None:
                raise ValueError("VramBudget needs reserve_mib or a DeviceRoom")
            room = DeviceRoom(device, float(reserve_mib))
        self.device = device
        self.room = room
        self.weights_mib = weights_mib
        self.kv_mib = kv_mib
        self.tier = tier
        self.graphs_mib = graphs_mib
        self.experts = experts
        self.experts_first = experts_first
        self.kv_paging = kv_paging
        self.weight_format = weight_format

    @property
    def reserve_mib(self) -> float:
        return self.room.reserve_mib

    @property
    def headroom_mib(self) -> float:
        return self.room.headroom_mib

    def breakdown(self) -> VramEvent:
        total, free = device_memory_mib(self.device)
        return VramEvent(device=str(self.device), total_mib=round(total, 1), weights_mib=round(self.weights_mib, 1),
                         kv_mib=round(self.kv_mib, 1), graphs_mib=round(self.graphs_mib, 1),
                         tier_mib=round(self.tier.mib if self.tier else 0.0, 1),
                         reserve_mib=round(self.reserve_mib, 1), free_mib=round(free, 1),
                         experts_mib=round(self.experts.mib if self.experts is not None else 0.0, 1),
                         host_kv_mib=round(self.kv_paging.host_mib if self.kv_paging is not None else 0.0, 1),
                         weight_format=self.weight_format)

    def driver_room_mib(self) -> float:
        return self.room.driver_room_mib()

    def kv_pool_resized(self) -> None:
        """KV by use: the pool tensors grew; the books' KV figure follows them."""
        self.kv_mib = self.kv_paging.kv.mib

    def tier_room_mib(self) -> float:
        return self.room.tier_room_mib()

    def make_room(self, mib: float, reason: str) -> float:
        """Free `mib` for a step that ran out of memory, from the tier then the expert cache (the other way round
        with `experts_first`), and keep that much free from now on (bounded by 4x the reserve) so neither regrows
        into it. Returns the MiB freed."""
        claimants = [c for c in (self.tier, self.experts) if c is not None]
        if self.experts_first:
            claimants.reverse()
        freed = 0.0
        for claimant in claimants:
            if freed >= mib:
                break
            freed += claimant.release(mib - freed, reason)
        self.room.headroom_mib = min(self.headroom_mib + freed, 4 * max(self.reserve_mib, 256.0))
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
        self.room.reserve_mib = float(mib)
        self.rebalance(f"vram reserve set to {mib} MiB")
