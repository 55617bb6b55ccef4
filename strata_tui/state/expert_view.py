"""What the monitor knows about an MoE engine's expert cache. Pure Python, no Textual.

Seeded and refreshed from the `experts` section of `/strata/state` (engine.exec.experts.cache.ExpertCache
.snapshot: slots, target, MiB, hit counters, the oracle's hit rate, per layer), and kept current between
snapshots by `expert` events (a shrink or grow moves the slots at once; loads are summed about once a second).
Misses per step are the counters' difference between two snapshots, so they describe the last seconds,
not the whole run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engine.snapshot import ExpertCacheSnapshot
from engine.telemetry import ExpertEvent


def _slot_mib(snapshot: ExpertCacheSnapshot) -> float:
    """Device MiB of one slot in every sparse layer (what one step of the budget keys moves)."""
    return float(snapshot.num_layers) * float(snapshot.expert_mib)


def _slots_for(mib: float, slot_mib: float) -> int:
    # engine.exec.experts.cache.ExpertCache.slots_for: each layer also holds one zero miss slot
    return max(0, int(mib // slot_mib) - 1)


def budget_step_mib(snapshot: ExpertCacheSnapshot, direction: int) -> int | None:
    """The whole-MiB budget one slot per layer above (+1) or below (-1) the current target, or None at
    the ends (every expert resident; one slot per layer). Budgets are whole MiB, so with small experts
    one step may move several slots: the nearest whole MiB that changes the slot count."""
    slot_mib = _slot_mib(snapshot)
    target = int(snapshot.target_slots or snapshot.slots or 0)
    num_experts = snapshot.num_experts
    if slot_mib <= 0 or not num_experts:
        return None
    if direction > 0:
        if target >= num_experts:
            return None
        mib = math.ceil(slot_mib * (target + 2))  # target + 1 slots plus the miss slot
        return mib
    if target <= 1:
        return None
    mib = math.floor(slot_mib * (target + 1))  # just under the current target's budget
    if _slots_for(mib, slot_mib) >= target:
        mib -= 1
    if _slots_for(mib, slot_mib) < 1:
        mib = math.ceil(slot_mib * 2)
    return mib if 0 < mib and _slots_for(mib, slot_mib) < target else None


@dataclass
class ExpertView:
    """The expert cache as the panel shows it (see the module docstring)."""

    snapshot: ExpertCacheSnapshot | None = None  # None: no `experts` section read yet
    misses_per_step: float | None = None
    last_resize: ExpertEvent | None = None
    loads_last: int = 0  # experts loaded in the last summed `load` event (about a second)
    load_mib_last: float = 0.0

    recent_hit_rate: float | None = None  # hits / lookups between the last two snapshots (the history's line)

    def update(self, snapshot: ExpertCacheSnapshot) -> None:
        """A new `experts` section: counters replace the old ones; misses per step and the recent hit rate from the
        difference."""
        before = self.snapshot
        steps, misses = snapshot.steps, snapshot.misses
        if before is not None and steps > before.steps:
            self.misses_per_step = (misses - before.misses) / (steps - before.steps)
        elif self.misses_per_step is None and steps:
            self.misses_per_step = misses / steps
        if before is not None and snapshot.hits + snapshot.misses > before.hits + before.misses:
            hits = snapshot.hits - before.hits
            self.recent_hit_rate = hits / (hits + snapshot.misses - before.misses)
        elif self.recent_hit_rate is None:
            self.recent_hit_rate = snapshot.hit_rate
        self.snapshot = snapshot

    def apply(self, event: ExpertEvent) -> None:
        if event.action in ("shrink", "grow"):
            if self.snapshot is not None:
                self.snapshot = dataclasses.replace(self.snapshot, slots=event.slots, mib=event.total_mib)
            self.last_resize = event
        elif event.action == "load":
            self.loads_last, self.load_mib_last = event.experts, event.mib

    # --- what the panel reads ------------------------------------------------------------------------

    def _get(self, key: str) -> Any:
        return getattr(self.snapshot, key) if self.snapshot is not None else None

    @property
    def slots(self) -> int | None:
        return self._get("slots")

    @property
    def target_slots(self) -> int | None:
        return self._get("target_slots")

    @property
    def num_experts(self) -> int | None:
        return self._get("num_experts")

    @property
    def mib(self) -> float | None:
        return self._get("mib")

    @property
    def host_mib(self) -> float | None:
        return self._get("host_mib")

    @property
    def hit_rate(self) -> float | None:
        return self._get("hit_rate")

    @property
    def oracle_hit_rate(self) -> float | None:
        return self._get("oracle_hit_rate")

    def layer_hit_rates(self) -> list[float | None]:
        return [layer.hit_rate for layer in self.snapshot.layers] if self.snapshot is not None else []

    def layer_heat(self, cells: int) -> list[float | None]:
        """Per-layer hit rates in at most `cells` cells, in layer order: one layer a cell when they fit, else
        consecutive layers share a cell that shows their *worst* rate (a cold layer is never averaged away);
        None where no layer of the cell was accessed yet."""
        rates = self.layer_hit_rates()
        if cells <= 0 or not rates:
            return []
        n = min(cells, len(rates))
        heat: list[float | None] = []
        for c in range(n):
            part = [r for r in rates[c * len(rates) // n:(c + 1) * len(rates) // n] if r is not None]
            heat.append(min(part) if part else None)
        return heat

    def worst_layers(self, n: int) -> list[tuple[int, float]]:
        """The `n` layers (sparse-layer index) with the lowest hit rates; layers with no access left out."""
        rates = [(i, r) for i, r in enumerate(self.layer_hit_rates()) if r is not None]
        return sorted(rates, key=lambda item: (item[1], item[0]))[:n]
