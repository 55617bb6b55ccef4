"""Strata itself, read as the other engines are (its /strata/state onto an EndpointView), for a row of its own
beside them: `--attach` with a Strata URL and a vLLM URL shows both. The Strata engine being monitored gets its
full panels from its event stream as well (strata_tui/state/monitor_state.py); this is the row in the endpoints
table."""

from __future__ import annotations

import httpx

from engine.snapshot import EngineSnapshot
from strata_tui.adapters.base import Adapter, get_json
from strata_tui.adapters.view import EndpointView

CANNOT = {
    "latency": "Strata's TTFT per request is in its slot rows, not a histogram",
}


class StrataAdapter(Adapter):
    kind = "strata"
    name = "Strata"

    async def fill(self, client: httpx.AsyncClient, view: EndpointView) -> None:
        view.cannot.update(CANNOT)
        snapshot = EngineSnapshot.from_json(await get_json(client, "/strata/state"))
        view.model = snapshot.model or str(snapshot.config.get("model") or "") or None
        busy = [s for s in snapshot.slots if s.state in ("prefill", "decode")]
        view.running, view.waiting = float(len(busy)), float(snapshot.queue.waiting)
        kv = snapshot.kv
        if kv is not None and kv.paging is not None and kv.paging.pool_blocks:
            view.kv_usage = kv.paging.used_blocks / kv.paging.pool_blocks if busy else 0.0
            view.preemptions = float(kv.paging.preemptions)
        elif kv is not None and kv.slots and kv.context_tokens:
            held = sum(s.prefilled_tokens + s.generated_tokens for s in busy)
            view.kv_usage = held / (kv.slots * kv.context_tokens)
        tier = snapshot.tier
        if tier is not None and tier.hit_blocks + tier.miss_blocks:
            view.prefix_hit = tier.hit_blocks / (tier.hit_blocks + tier.miss_blocks)
        else:
            view.cannot["prefix"] = "no prefix-cache lookups yet" if tier is not None else "no prefix-cache tier"
        mtp = snapshot.mtp
        if mtp.enabled and mtp.draft_proposed and mtp.draft_proposed[0]:
            view.spec_per_position = [a / p if p else 0.0 for a, p in zip(mtp.draft_accepted, mtp.draft_proposed)]
            view.spec_mean_length = 1 + sum(mtp.draft_accepted) / mtp.draft_proposed[0]
        else:
            view.cannot["spec"] = mtp.disabled_reason or ("MTP off" if not mtp.enabled else "no drafts yet")
        view.prompt_tokens_s = sum(s.prefill_tok_s for s in busy if s.state == "prefill")
        view.decode_tokens_s = sum(s.decode_tok_s for s in busy if s.state == "decode")
        view.cannot["slots"] = "Strata's slots are in the slots panel (the engine this monitor follows)"
