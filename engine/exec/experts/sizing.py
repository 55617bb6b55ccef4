"""The expert cache as a claimant in the VRAM books (engine.exec.experts.cache.ExpertCache, whose base this is): its
sizes, a shrink on request (`release`), a budget (`set_budget`, `retarget`) and regrowth into measured room
(`grow`). A resize reallocates every layer's pool, one layer at a time, and drops the captured graphs that read
the old pools (`on_resize`). Memory can run out in the middle of one: a layer's new tensors are allocated before
anything of it changes (engine.exec.experts.pool), a shrink with no room beside the old pool frees it first, and a
growth short part-way puts the layers that grew back, so every layer keeps one size and no graph reads freed memory.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.exec.experts.pool import ExpertPool
from engine.exec.gpu_errors import real_message
from engine.telemetry import EventBus, ExpertEvent, WarningEvent


class SizedExperts:
    """The sizing methods; what they read is the cache's own (ExpertCache.__init__ makes it)."""

    pools: list[ExpertPool]
    bus: EventBus
    device: torch.device
    copy_stream: torch.cuda.Stream | None
    expert_mib: float
    num_experts: int
    min_slots: int
    target_slots: int
    store_mib: float
    peer: torch.device | None
    on_resize: Callable[[], None]
    _copy: Callable[[torch.Tensor, torch.Tensor], None]
    _load: Callable[..., None]

    # --- sizes -------------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.pools)

    @property
    def slots(self) -> int:
        return self.pools[0].slots

    def mib_for(self, slots: int) -> float:
        """Device MiB of `slots` slots per layer (plus each layer's miss slot)."""
        return self.num_layers * (slots + 1) * self.expert_mib

    def slots_for(self, mib: float) -> int:
        """Slots per layer that `mib` MiB hold (uncapped)."""
        return max(0, int(mib // (self.num_layers * self.expert_mib)) - 1)

    def clamp_slots(self, slots: int) -> int:
        return max(self.min_slots, min(self.num_experts, slots))

    @property
    def mib(self) -> float:
        """Device memory the pools hold now."""
        return self.mib_for(self.slots)

    @property
    def min_mib(self) -> float:
        """The smallest budget: `min_slots` per layer plus each layer's miss slot."""
        return self.mib_for(self.min_slots)

    @property
    def all_experts_mib(self) -> float:
        return self.num_layers * self.num_experts * self.expert_mib

    @property
    def host_mib(self) -> float:
        return self.store_mib if self.peer is None else 0.0

    @property
    def peer_mib(self) -> float:
        """The store on the --peer-device card (every expert once); 0 with a host store."""
        return 0.0 if self.peer is None else self.store_mib

    # --- the claimant: shrink, grow ----------------------------------------------------------------------

    def release(self, mib: float, reason: str) -> float:
        """Give back at least `mib` MiB if the pools have it (never below `min_slots`); returns MiB freed."""
        if mib <= 0 or self.slots <= self.min_slots:
            return 0.0
        per_slot = self.num_layers * self.expert_mib
        want = self.clamp_slots(self.slots - max(1, int(-(-mib // per_slot))))
        before = self.mib
        self._resize(want, reason)
        return before - self.mib

    def set_budget(self, mib: float, reason: str) -> None:
        """Make `mib` the target and resize to it (whole slots, capped at every expert)."""
        self.target_slots = self.clamp_slots(self.slots_for(mib))
        self._resize(self.target_slots, reason)

    def retarget(self, mib: float, reason: str) -> None:
        """A live budget change: make `mib` the target and shrink to it at once; a larger target is reached by
        `grow`, as far as the VRAM books allow (VramBudget.set_expert_budget)."""
        self.target_slots = self.clamp_slots(self.slots_for(mib))
        if self.target_slots < self.slots:
            self._resize(self.target_slots, reason)

    def grow(self, room_mib: float, reason: str) -> float:
        """Regrow towards the target into `room_mib` of measured room; returns MiB added. A growth that runs out
        of memory all the same (the room was measured, then taken) leaves the cache at its size, says so once, and
        makes that size the target until the budget is set again: retried every rebalance, each attempt would
        copy layers and drop the captured graphs."""
        per_slot = self.num_layers * self.expert_mib
        slots = min(self.target_slots, self.slots + int(room_mib // per_slot))
        if slots <= self.slots:
            return 0.0
        before = self.mib
        try:
            self._resize(slots, reason)
        except torch.OutOfMemoryError as exc:
            self.target_slots = self.slots
            self.bus.publish(WarningEvent(where="experts.grow", message=(
                f"expert cache: growing to {slots} slots per layer ({reason}) ran out of memory: "
                f"{real_message(exc)}; it stays at {self.slots} slots until its budget is set again")))
            return 0.0
        return self.mib - before

    def _resize(self, slots: int, reason: str) -> None:
        """Every layer to `slots` slots, one at a time (the peak is one layer's old and new pool). A growth that
        runs out of memory part-way puts the layers that grew back to the others' size (a shrink, which can free
        first) and raises; their tensors moved, so the captured graphs that read them are dropped."""
        before, t0 = self.mib, time.perf_counter()
        if self.pools[0].gate_up.numel() and slots == self.slots:
            return
        old_slots, done = self.slots, 0
        try:
            for i, pool in enumerate(self.pools):
                pool.allocate(slots, self._copy)
                done = i + 1
                if slots >= self.num_experts:  # every expert fits: load them all now, so none ever misses
                    missing = [e for e in range(self.num_experts) if not pool.policy.resident(e)]
                    self._load(pool, missing and pool.policy.serve(missing).loads or [], [], layer=i)
        except torch.OutOfMemoryError:
            if slots > old_slots:  # a shrink short even of its staged room has nothing to go back to
                for pool in self.pools[:done]:
                    pool.allocate(old_slots, self._copy)
            if done:
                self._settle()
            raise
        self._settle()
        self.bus.publish(ExpertEvent(action="grow" if self.mib >= before else "shrink",
                                     mib=round(abs(self.mib - before), 3), total_mib=round(self.mib, 3), slots=slots,
                                     ms=round((time.perf_counter() - t0) * 1e3, 3), reason=reason,
                                     device=str(self.device)))

    def _settle(self) -> None:
        """After the pools were reallocated: the copies into them done, the old pools' memory given back, the
        graphs that read the old pools dropped."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            torch.cuda.empty_cache()
        self.on_resize()
