"""Read-side views of a running engine: slot progress (for SlotEvents) and the /strata/state snapshot.

Both are built from the scheduler's Request objects, so the TUI's slot table and the telemetry stream show
the same numbers. Both run on the engine thread; the snapshot is then published whole (engine.snapshot).
"""

from __future__ import annotations

import time
from typing import Any

from engine.api import Health
from engine.config import EngineConfig
from engine.core.request import Request, RequestState
from engine.core.scheduler import Scheduler
from engine.exec.step_fns import StepExecutor
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.tier import AdaptiveTier, VramBudget
from engine.snapshot import (EngineSnapshot, HealthSnapshot, KvPagingSnapshot, KvSnapshot, MtpSnapshot,
                             QueueSnapshot, SwitchSnapshot, TierSnapshot)
from engine.switches import SwitchBoard
from engine.telemetry import SlotEvent


def kv_placement(req: Request, slot: int, kv: SlotKVCache | None) -> tuple[int, int, int]:
    """(resident, pooled, host) tokens of the slot's KV: where each written position lies (`--kv-resident`);
    without paging every token is in the slot's own device memory (resident)."""
    length = req.num_computed_tokens + max(0, req.num_output_tokens - 1)  # the newest token's KV is written next
    if kv is None or kv.paging is None:
        return length, 0, 0
    return kv.paging.placement_tokens(slot, length)


def slot_event(req: Request, slot: int, state: str | None = None, now_s: float | None = None,
               kv: SlotKVCache | None = None) -> SlotEvent:
    """One slot's progress: prefilled tokens and rate with an ETA while prefilling; generated tokens, decode
    rate and MTP acceptance while decoding; where its KV lies."""
    resident, pooled, host = kv_placement(req, slot, kv)
    now_s = time.monotonic() if now_s is None else now_s
    prefill_tok_s = req.prefill_tok_s(now_s) or 0.0
    eta_s = req.prefill_eta_s(now_s) if req.first_token_s is None else None
    eta_s = None if eta_s is None else round(eta_s, 3)
    if state is None:
        state = {RequestState.PREFILL: "prefill", RequestState.DECODE: "decode"}.get(req.state, "finished")
        if state == "decode" and not req.output_token_ids:
            state = "prefill"  # its last chunk is planned but not yet run
    return SlotEvent(
        slot=slot, state=state, request_id=req.request_id, prompt_tokens=req.num_prompt_tokens,
        cached_tokens=req.num_cached_tokens, prefilled_tokens=req.num_computed_tokens,
        generated_tokens=req.num_output_tokens, max_tokens=req.max_tokens,
        prefill_tok_s=round(prefill_tok_s, 2), decode_tok_s=round(req.decode_tok_s(now_s) or 0.0, 2),
        acceptance=None if req.acceptance is None else round(req.acceptance, 4), eta_s=eta_s,
        acceptance_per_position=[None if a is None else round(a, 4)
                                 for a in (req.acceptance_at(i) for i in range(len(req.draft_proposed)))],
        kv_resident_tokens=resident, kv_pooled_tokens=pooled, kv_host_tokens=host,
    )


class SlotViews:
    """The snapshot's slot entries, kept between snapshots. An entry is built again when its slot's request or
    that request's state changed, or once it is `max_age_s` old; up to the slots the engine reports at full rate
    that age is 0 (every snapshot builds every entry). A snapshot is forced whenever a request is admitted or
    finishes, at 256 busy slots nearly every step, and building every slot's entry took longer than the rest of
    the snapshot: past those slots an entry lives as long as the slot's progress interval (the engine's progress
    events' own rule), and only the slots that changed are built again at once."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Request, tuple, float, SlotEvent]] = {}

    def entry(self, req: Request | None, slot: int, now_s: float, kv: SlotKVCache | None,
              max_age_s: float) -> SlotEvent:
        if req is None:
            self._entries.pop(slot, None)  # no finished request held past its slot
            return SlotEvent(slot=slot, state="idle")
        state = (req.state, bool(req.output_token_ids))
        kept = self._entries.get(slot)
        if kept is not None and kept[0] is req and kept[1] == state and now_s - kept[2] < max_age_s:
            return kept[3]
        event = slot_event(req, slot, now_s=now_s, kv=kv)
        event.acceptance_per_position = [req.acceptance_at(i) for i in range(len(req.draft_proposed))]
        self._entries[slot] = (req, state, now_s, event)
        return event


def build_snapshot(*, model: str, config: EngineConfig, health: Health, board: SwitchBoard, sched: Scheduler,
                   graphs: StepExecutor, budgets: list[VramBudget], tier: AdaptiveTier, kv: SlotKVCache,
                   mtp: MtpSnapshot, steps: int, experts: Any = None, oracle_max_age_s: float = 0.0,
                   now_s: float | None = None, slot_views: SlotViews | None = None,
                   slot_max_age_s: float = 0.0) -> EngineSnapshot:
    """The /strata/state snapshot of this moment. Runs on the engine thread only (it reads the scheduler, the
    tier and the driver's free memory, which that thread changes). `slot_views`: the slot entries kept from the
    last snapshot, reused up to `slot_max_age_s` (SlotViews)."""
    now_s = time.monotonic() if now_s is None else now_s
    views = SlotViews() if slot_views is None else slot_views
    slots = [views.entry(sched.slot_request(slot), slot, now_s, kv, slot_max_age_s) for slot in range(config.batch)]
    return EngineSnapshot(
        model=model, config=config.to_dict(),
        health=HealthSnapshot(ready=health.ready, reason=health.reason, status=health.status),
        switches=[SwitchSnapshot.from_json(s) for s in board.snapshot()],
        queue=QueueSnapshot(waiting=sched.num_waiting, queue_max=sched.queue_max,
                            prefill_tokens=sched.prefill_tokens_waiting(), admission_wait=sched.admission_wait),
        slots=slots, graphs=graphs.snapshot(),
        vram=[budget.breakdown() for budget in budgets], tier=TierSnapshot.from_json(tier.snapshot()),
        kv=KvSnapshot(storage=kv.storage, mib=round(kv.mib, 2), context_tokens=kv.geometry.context_tokens,
                      slots=kv.geometry.num_slots,
                      paging=kv.paging.snapshot() if kv.paging is not None else None),
        experts=experts.snapshot(oracle_max_age_s) if experts is not None else None, mtp=mtp, steps=steps)
