"""What the engine tells its watchers between steps, paced: slot progress (at most ~10 Hz a slot) and the VRAM
books (about once a second, each device's tier rebalanced first). Engine thread only.

Kept apart from the step loop so `engine.py` only orchestrates; the events themselves are built in `state.py`
(slot progress) and `exec/vram.py` (the books).
"""

from __future__ import annotations

import time

from engine.core.output import OutputProcessor
from engine.core.request import Request
from engine.exec.executor import StepExecutor
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.tier import VramBudget
from engine.orchestration.state import slot_event
from engine.telemetry import EventBus

SLOT_EVENT_INTERVAL_S = 0.1  # progress events per slot at most ~10 Hz
VRAM_EVENT_INTERVAL_S = 1.0


class Reporter:
    def __init__(self, bus: EventBus, budgets: list[VramBudget], executor: StepExecutor,
                 output: OutputProcessor, kv: SlotKVCache | None = None) -> None:
        self.bus = bus
        self.kv = kv  # where each slot's KV lies (--kv-resident), in its slot events
        self.budgets = budgets
        self.executor = executor
        self.output = output
        self.slot_interval_s = SLOT_EVENT_INTERVAL_S
        self._last_vram_s = 0.0

    def slot(self, req: Request, slot: int, state: str | None, now_s: float) -> None:
        """A slot's state now (a change of state, or progress when `state` is None)."""
        self.bus.publish(slot_event(req, slot, state, now_s, self.kv))
        track = self.output.get(req.request_id)
        if track is not None:
            track.last_event_s = now_s

    def progress(self, now_s: float) -> None:
        """After a step: progress of every slot not reported for a while, and the books when due."""
        for track in self.output:
            req = track.request
            if req.slot is not None and now_s - track.last_event_s >= self.slot_interval_s:
                self.slot(req, req.slot, None, now_s)
        self.vram()

    def vram(self, force: bool = False) -> None:
        now_s = time.monotonic()
        if not force and now_s - self._last_vram_s < VRAM_EVENT_INTERVAL_S:
            return
        self._last_vram_s = now_s
        self.budgets[0].graphs_mib = self.executor.snapshot().total_mib
        for budget in self.budgets:
            budget.rebalance("periodic")
            self.bus.publish(budget.breakdown())
