"""The adapter interface: one instance per endpoint; `read(client)` asks the engine's routes and returns an
EndpointView. The HTTP client is httpx.AsyncClient with the endpoint's base URL."""

from __future__ import annotations

import time
from typing import Any

import httpx

from strata_tui.adapters.prometheus import Histogram, Metrics
from strata_tui.adapters.rates import CounterRates
from strata_tui.adapters.view import EndpointView


class Adapter:
    kind = ""
    name = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rates = CounterRates()  # token counters between reads: the rates (strata_tui/adapters/rates.py)

    async def read(self, client: httpx.AsyncClient) -> EndpointView:
        view = EndpointView(self.url, self.kind)
        await self.fill(client, view)
        view.reachable, view.read_at = True, time.time()
        return view

    async def fill(self, client: httpx.AsyncClient, view: EndpointView) -> None:
        raise NotImplementedError


async def get_json(client: httpx.AsyncClient, path: str) -> Any:
    response = await client.get(path)
    response.raise_for_status()
    return response.json()


async def get_metrics(client: httpx.AsyncClient, path: str = "/metrics") -> Metrics | None:
    """The scrape, or None when the server has no /metrics (llama.cpp without --metrics, SGLang without
    --enable-metrics): the panels then say so."""
    response = await client.get(path)
    if response.status_code in (404, 501):
        return None
    response.raise_for_status()
    return Metrics(response.text)


def token_rates(view: EndpointView, rates: CounterRates, metrics: Metrics, prompt_counter: str,
                decode_counter: str, prompt_gauge: str | None = None, decode_gauge: str | None = None) -> None:
    """Prompt and decode tok/s from the token counters between this read and the last; a gauge only where the
    engine exports no counter (the first read, with nothing to compare yet, shows the gauge or nothing)."""
    for attr, counter, gauge in (("prompt_tokens_s", prompt_counter, prompt_gauge),
                                 ("decode_tokens_s", decode_counter, decode_gauge)):
        value = rates.rate(counter, metrics.sum(counter))
        if value is None and not metrics.has(counter) and gauge is not None:
            value = metrics.sum(gauge)
        setattr(view, attr, value)


def latency(view: EndpointView, ttft: Histogram | None, itl: Histogram | None) -> None:
    """TTFT and inter-token latency quantiles from the engine's own histograms (since it started)."""
    if ttft is not None:
        view.ttft_p50_s, view.ttft_p95_s = ttft.quantile(0.5), ttft.quantile(0.95)
        view.latency_requests = int(ttft.count)
    if itl is not None:
        view.itl_p50_s, view.itl_p95_s = itl.quantile(0.5), itl.quantile(0.95)
