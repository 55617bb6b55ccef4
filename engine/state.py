"""Read-side views of a running engine: slot progress (for SlotEvents) and the /strata/state snapshot.

Both are built from the scheduler's Request objects, so the TUI's slot table and the telemetry stream show
the same numbers. Everything here only reads engine state; it may run on the server thread while the engine
thread steps (a snapshot can be one step stale, never torn inside one field).
"""

from __future__ import annotations

import time
from typing import Any

from engine.core.request import Request, RequestState
from engine.telemetry import SlotEvent


def slot_event(req: Request, slot: int, state: str | None = None, now_s: float | None = None) -> SlotEvent:
    """One slot's progress: prefilled tokens and rate with an ETA while prefilling; generated tokens, decode
    rate and MTP acceptance while decoding."""
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
    )


def engine_state(engine: Any) -> dict[str, Any]:
    """Snapshot for /strata/state: config, switches, slots, graph cache, VRAM breakdown, tier, MTP."""
    now_s = time.monotonic()
    slots = []
    for slot in range(engine.config.batch):
        req = engine.sched.slot_request(slot)
        if req is None:
            slots.append({"slot": slot, "state": "idle", "request_id": None})
        else:
            entry = slot_event(req, slot, now_s=now_s).to_json()
            entry["acceptance_per_position"] = [req.acceptance_at(i) for i in range(len(req.draft_proposed))]
            slots.append(entry)
    executor = engine.executor
    graphs = executor.snapshot() if hasattr(executor, "snapshot") else {"enabled": False, "graphs": [], "total_mib": 0.0}
    return {
        "model": engine.model_name,
        "config": engine.config.to_dict(),
        "health": {"ready": engine.health().ready, "reason": engine.health().reason},
        "switches": engine.board.snapshot(),
        "queue": {"waiting": engine.sched.num_waiting, "queue_max": engine.sched.queue_max},
        "slots": slots,
        "graphs": graphs,
        "vram": [budget.breakdown().to_json() for budget in engine.budgets],
        "tier": engine.tier.snapshot(),
        "experts": _experts(engine),
        "kv": {"storage": engine.kv.storage, "mib": round(engine.kv.mib, 2),
               "context_tokens": engine.kv.geometry.context_tokens, "slots": engine.kv.geometry.num_slots},
        "mtp": {"enabled": engine.mtp_on, "depth": engine.config.mtp_depth if engine.config.batch_mtp else 0,
                "disabled_reason": engine.mtp_off_reason},
        "steps": engine.steps,
    }


def _experts(engine: Any) -> dict[str, Any] | None:
    """The MoE expert cache's snapshot (engine.exec.expert_cache), or None for a dense model."""
    cache = getattr(engine.lm.model, "expert_provider", None)
    return cache.snapshot() if cache is not None else None
