"""SGLang (python/sglang/srt/metrics/collector.py with --enable-metrics; /get_server_info of its HTTP server).

Its scheduler reports token usage of one pool (not blocks), a prefix (radix) cache hit rate as a gauge, and
speculative acceptance as a mean length and rate: no per-position breakdown, no per-request progress."""

from __future__ import annotations

import httpx

from strata_tui.adapters.base import Adapter, get_json, get_metrics, latency, token_rates
from strata_tui.adapters.view import EndpointView

CANNOT = {
    "slots": "SGLang has no slots: its scheduler batches requests by token budget",
    "prefill": "SGLang exposes no per-request prefill progress",
}


class SglangAdapter(Adapter):
    kind = "sglang"
    name = "SGLang"

    async def fill(self, client: httpx.AsyncClient, view: EndpointView) -> None:
        view.cannot.update(CANNOT)
        view.kv_label = "tokens"
        try:
            info = await get_json(client, "/get_server_info")
            view.version = str(info.get("version")) if info.get("version") else None
            view.model = info.get("served_model_name") or info.get("model_path")
            speculative = info.get("speculative_algorithm")
        except (httpx.HTTPError, ValueError, AttributeError):
            speculative = None
        metrics = await get_metrics(client, view)
        if metrics is None:
            for panel in ("requests", "kv", "prefix", "spec", "latency", "preemptions"):
                view.cannot[panel] = "SGLang serves no /metrics: launch it with --enable-metrics"
            return
        view.running = metrics.sum("sglang:num_running_reqs")
        view.waiting = metrics.sum("sglang:num_queue_reqs")
        view.kv_usage = metrics.mean("sglang:token_usage")
        view.prefix_hit = metrics.mean("sglang:cache_hit_rate")
        if view.prefix_hit is None:
            view.cannot["prefix"] = "SGLang reports no cache hit rate"
        view.preemptions = metrics.sum(metrics.first("sglang:num_retracted_requests_total",
                                                     "sglang:num_retracted_reqs"))
        token_rates(view, self.rates, metrics, "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                    decode_gauge="sglang:gen_throughput")
        length = metrics.mean("sglang:spec_accept_length")
        if speculative and length:
            view.spec_mean_length = length
            view.spec_rate = metrics.mean("sglang:spec_accept_rate")
            view.cannot["spec"] = "SGLang reports a mean acceptance, not per draft position"
        else:
            view.cannot["spec"] = "speculative decoding off"
        latency(view, metrics.histogram("sglang:time_to_first_token_seconds"),
                metrics.histogram("sglang:inter_token_latency_seconds"))
        if view.latency_requests is None:
            view.cannot["latency"] = "SGLang reports no TTFT histogram"
