"""vLLM (the V1 engine's Prometheus logger, vllm/v1/metrics/loggers.py, and /version of its OpenAI server).

Counters end in `_total` in the scrape; several engines (data parallel) are an `engine` label and are summed.
"""

from __future__ import annotations

import httpx

from strata_tui.adapters.base import Adapter, get_json, get_metrics, latency, token_rates
from strata_tui.adapters.view import EndpointView

CANNOT = {
    "slots": "vLLM has no slots: it schedules requests by a token budget per step",
    "prefill": "vLLM exposes no per-request prefill progress",
}


class VllmAdapter(Adapter):
    kind = "vllm"
    name = "vLLM"

    async def fill(self, client: httpx.AsyncClient, view: EndpointView) -> None:
        view.cannot.update(CANNOT)
        try:
            view.version = str((await get_json(client, "/version")).get("version"))
        except (httpx.HTTPError, ValueError, AttributeError):
            view.version = None
        metrics = await get_metrics(client, view)
        if metrics is None:
            for panel in ("requests", "kv", "prefix", "spec", "latency", "preemptions"):
                view.cannot[panel] = "vLLM answered no /metrics"
            return
        names = metrics.samples
        model = next((s.labels.get("model_name") for s in names.get("vllm:num_requests_running", ())), None)
        view.model = model
        view.running = metrics.sum("vllm:num_requests_running")
        view.waiting = metrics.sum("vllm:num_requests_waiting")
        view.kv_usage = metrics.mean(metrics.first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
        queries = metrics.sum(metrics.first("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"))
        hits = metrics.sum(metrics.first("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"))
        if queries:
            view.prefix_hit = (hits or 0.0) / queries
        elif queries is None:
            view.cannot["prefix"] = "vLLM reports no prefix-cache counters"
        else:
            view.cannot["prefix"] = "no prefix-cache lookups yet"
        view.preemptions = metrics.sum("vllm:num_preemptions_total")
        token_rates(view, self.rates, metrics, "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
        drafts = metrics.sum("vllm:spec_decode_num_drafts_total")
        if drafts is None:
            view.cannot["spec"] = "speculative decoding off (no vllm:spec_decode_* metrics)"
        elif drafts == 0:
            view.cannot["spec"] = "no drafts yet"
        else:
            per_pos = metrics.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
            view.spec_per_position = [per_pos[p] / drafts for p in sorted(per_pos, key=int)]
            accepted = metrics.sum("vllm:spec_decode_num_accepted_tokens_total") or 0.0
            drafted = metrics.sum("vllm:spec_decode_num_draft_tokens_total")
            view.spec_mean_length = 1 + accepted / drafts
            view.spec_rate = accepted / drafted if drafted else None
        latency(view, metrics.histogram("vllm:time_to_first_token_seconds"),
                metrics.histogram("vllm:inter_token_latency_seconds")
                or metrics.histogram("vllm:time_per_output_token_seconds"))
        if view.latency_requests is None:
            view.cannot["latency"] = "vLLM reports no TTFT histogram"
