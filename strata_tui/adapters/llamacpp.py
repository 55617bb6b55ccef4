"""llama.cpp's `llama-server` (tools/server: /props, /slots with --slots, /metrics with --metrics).

It is the one engine here with slots: each `/slots` entry has its context, the tokens its cache holds (the
prompt so far plus what it generated), how many prompt tokens it has processed and how many it decoded. The
prompt's full length is not in `/slots` (only in its log), so prefill progress is a count of tokens processed,
not a fraction. Its metrics are counters and mean rates, no histograms: no TTFT or inter-token quantiles."""

from __future__ import annotations

import json
import math

import httpx

from strata_tui.adapters.base import MAX_COUNT, Adapter, fetch, get_json, get_metrics, token_rates
from strata_tui.adapters.view import EndpointView, SlotRow

CANNOT = {
    "latency": "llama.cpp exports no latency histograms (mean prompt and decode rates only)",
    "preemptions": "llama.cpp does not preempt: a request waits for a free slot (deferred)",
    "prefill": "llama.cpp's /slots counts prompt tokens processed, not the prompt's length: no fraction",
}


def slot_rows(data: list) -> list[SlotRow]:
    rows = []
    for slot in data:
        if not isinstance(slot, dict):
            continue
        processing = bool(slot.get("is_processing"))
        held = _count(slot.get("n_prompt_tokens"))  # the slot's cache: prompt so far plus generated tokens
        done = _count(slot.get("n_prompt_tokens_processed"))
        cached = _count(slot.get("n_prompt_tokens_cache")) or 0
        next_token = (slot.get("next_token") or [{}])
        next_token = next_token[0] if isinstance(next_token, list) and isinstance(next_token[0], dict) else {}
        decoded = _count(next_token.get("n_decoded"))
        if done is not None:
            done = done + cached  # a cached prefix needs no processing: it counts as done
        if not processing:
            state = "idle"
        elif not decoded:
            state = "prefill"
        else:
            state = "decode"
        slot_id = _count(slot.get("id"))
        rows.append(SlotRow(len(rows) if slot_id is None else slot_id, state, _count(slot.get("n_ctx")), None, done,
                            decoded, _count(slot.get("id_task")), held))
    return rows


def _count(value) -> int | None:
    """A count from the server's JSON, or None where it is not one (a string, NaN, negative, astronomic)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if 0 <= value <= MAX_COUNT else None


class LlamacppAdapter(Adapter):
    kind = "llamacpp"
    name = "llama.cpp"

    async def fill(self, client: httpx.AsyncClient, view: EndpointView) -> None:
        view.cannot.update(CANNOT)
        view.kv_label = "ctx"
        props = await get_json(client, "/props")
        view.version = str(props.get("build_info") or "") or None
        path = props.get("model_path") or ""
        view.model = path.rsplit("/", 1)[-1] or props.get("model_alias")
        status, body = await fetch(client, "/slots")
        if status == 200:
            data = json.loads(body)
            view.slots = slot_rows(data if isinstance(data, list) else [])
            held = sum(min(s.context_tokens or 0, s.held_tokens or 0) for s in view.slots)
            context = sum(s.context_tokens or 0 for s in view.slots)
            view.kv_usage = held / context if context else None
            view.running = float(sum(1 for s in view.slots if s.state != "idle"))
        else:
            why = "llama-server serves no /slots: launch it with --slots"
            view.cannot["slots"] = view.cannot["prefill"] = why
            view.cannot["kv"] = "llama.cpp's context use is read from /slots: launch it with --slots"
        metrics = await get_metrics(client, view)
        if metrics is None:
            for panel in ("prefix", "spec"):
                view.cannot[panel] = "llama-server serves no /metrics: launch it with --metrics"
            if view.slots is None:
                view.cannot["requests"] = "llama-server serves neither /slots nor /metrics"
            return
        if view.running is None:
            view.running = metrics.sum("llamacpp:requests_processing")
        view.waiting = metrics.sum("llamacpp:requests_deferred")
        computed = metrics.sum("llamacpp:prompt_tokens_total")
        cached = metrics.sum("llamacpp:prompt_tokens_cached_total")
        if cached is None:
            view.cannot["prefix"] = "this llama-server build reports no cached prompt tokens"
        elif (computed or 0) + cached > 0:
            view.prefix_hit = cached / ((computed or 0) + cached)
        else:
            view.cannot["prefix"] = "no prompts yet"
        drafts = metrics.sum("llamacpp:spec_decode_num_drafts_total")
        if drafts:
            accepted = metrics.sum("llamacpp:spec_decode_num_accepted_tokens_total") or 0.0
            drafted = metrics.sum("llamacpp:spec_decode_num_draft_tokens_total")
            view.spec_mean_length = 1 + accepted / drafts
            view.spec_rate = accepted / drafted if drafted else None
            view.cannot["spec"] = "llama.cpp reports a mean acceptance, not per draft position"
        else:
            view.cannot["spec"] = "speculative decoding off (no drafts)"
        # Its rate gauges are means over the requests finished since the last scrape: 0 while slots decode.
        token_rates(view, self.rates, metrics, "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                    "llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds")
