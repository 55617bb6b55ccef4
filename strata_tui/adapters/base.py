"""The adapter interface: one instance per endpoint; `read(client)` asks the engine's routes and returns an
EndpointView. The HTTP client is httpx.AsyncClient with the endpoint's base URL.

A server is read as untrusted: every body is read up to MAX_BODY_BYTES and no further (a 50 MB /metrics took
the app to 733 MiB and seconds per key), the Prometheus text is parsed off the UI's event loop, and every
value the panels show is checked against its range afterwards (`sanitize`): NaN, a count below zero or a KV
use of 1e300 is shown as invalid with the reason, never as a number, and never taken for an unreachable
server."""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import time
from typing import Any

import httpx

from strata_tui.adapters.prometheus import Histogram, Metrics
from strata_tui.adapters.rates import CounterRates
from strata_tui.adapters.view import EndpointView

MAX_BODY_BYTES = 4 << 20  # a vLLM /metrics with every label set is about 1 MiB
MAX_COUNT = 1e12  # requests, preemptions, observations: past this a count is not one
MAX_SECONDS = 1e6
MAX_RATE = 1e9  # tokens a second
READING: contextvars.ContextVar[str] = contextvars.ContextVar("strata_reading", default="")  # the route being read


class TooLarge(ValueError):
    """A body past MAX_BODY_BYTES: not read further."""


class Adapter:
    kind = ""
    name = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rates = CounterRates()  # token counters between reads: the rates (strata_tui/adapters/rates.py)

    async def read(self, client: httpx.AsyncClient) -> EndpointView:
        view = EndpointView(self.url, self.kind)
        await self.fill(client, view)
        sanitize(view)
        view.reachable, view.read_at = True, time.time()
        return view

    async def fill(self, client: httpx.AsyncClient, view: EndpointView) -> None:
        raise NotImplementedError


async def fetch(client: httpx.AsyncClient, path: str, limit_bytes: int = MAX_BODY_BYTES,
                **request: Any) -> tuple[int, bytes]:
    """(status, body) of GET `path`, the body read to `limit_bytes` at most (TooLarge past it). `request`: httpx's
    per-request options (a `timeout`)."""
    READING.set(path)
    async with client.stream("GET", path, **request) as response:
        return response.status_code, await read_body(response, path, limit_bytes)


async def read_body(response: httpx.Response, path: str, limit_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body of a streamed `response` to `path`, read to `limit_bytes` at most: TooLarge, saying so, when its
    declared length or what arrives passes that (what arrived is dropped, the rest never read)."""
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit_bytes:
        raise TooLarge(f"{path} answered {_size(int(declared))}: too large to read (the limit is "
                       f"{_size(limit_bytes)})")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit_bytes:
            raise TooLarge(f"{path} answered over {_size(limit_bytes)}: too large to read")
        chunks.append(chunk)
    return b"".join(chunks)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.0f} MiB" if n_bytes >= 1 << 20 else f"{n_bytes / 1024:.0f} KiB"


async def get_json(client: httpx.AsyncClient, path: str) -> Any:
    status, body = await fetch(client, path)
    if status != 200:
        raise ValueError(f"{path} answered {status}")
    return json.loads(body)


async def get_metrics(client: httpx.AsyncClient, view: EndpointView, path: str = "/metrics") -> Metrics | None:
    """The scrape, or None when the server has no /metrics (llama.cpp without --metrics, SGLang without
    --enable-metrics): the panels then say so. The families the adapter reads that the scrape refused (NaN,
    below zero, a repeated series) are listed in `view.invalid`."""
    status, body = await fetch(client, path)
    if status in (404, 501):
        return None
    if status != 200:
        raise ValueError(f"{path} answered {status}")
    text = body.decode("utf-8", "replace")
    metrics = await asyncio.to_thread(Metrics, text)  # a big scrape parses for long: not on the UI's loop
    metrics.reported = view.invalid  # what the adapter reads of an invalid family is listed on the view
    return metrics


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
        view.latency_requests = ttft.count
    if itl is not None:
        view.itl_p50_s, view.itl_p95_s = itl.quantile(0.5), itl.quantile(0.95)


# field -> (lowest, highest, what it is): a value outside is shown as invalid, with the reason
RANGES: dict[str, tuple[float, float, str]] = {
    "running": (0, MAX_COUNT, "requests running"), "waiting": (0, MAX_COUNT, "requests waiting"),
    "preemptions": (0, MAX_COUNT, "preemptions"), "latency_requests": (0, MAX_COUNT, "TTFT observations"),
    "kv_usage": (0, 1, "KV use"), "prefix_hit": (0, 1, "prefix hit rate"), "spec_rate": (0, 1, "acceptance rate"),
    "spec_mean_length": (1, 1000, "mean accepted length"),
    "ttft_p50_s": (0, MAX_SECONDS, "TTFT p50"), "ttft_p95_s": (0, MAX_SECONDS, "TTFT p95"),
    "itl_p50_s": (0, MAX_SECONDS, "ITL p50"), "itl_p95_s": (0, MAX_SECONDS, "ITL p95"),
    "prompt_tokens_s": (0, MAX_RATE, "prompt tokens/s"), "decode_tokens_s": (0, MAX_RATE, "decode tokens/s"),
}


def sanitize(view: EndpointView) -> None:
    """Every value out of its range (RANGES) becomes None, with `view.invalid[field]` saying what it was."""
    for name, (low, high, what) in RANGES.items():
        value = getattr(view, name)
        if value is None:
            continue
        if not _in_range(value, low, high):
            setattr(view, name, None)
            # NaN comes from a family the scrape refused: its own entry already says what it held
            nan = isinstance(value, float) and math.isnan(value)
            view.invalid[name] = "" if nan else f"{what} {_shown(value)} (expected {_shown(low)}..{_shown(high)})"
    if view.spec_per_position is not None and not all(_in_range(v, 0, 1) for v in view.spec_per_position):
        bad = next(v for v in view.spec_per_position if not _in_range(v, 0, 1))
        view.spec_per_position = None
        view.invalid["spec_per_position"] = f"acceptance per position {_shown(bad)} (expected 0..1)"
    if view.latency_requests is not None:
        view.latency_requests = int(view.latency_requests)


def _in_range(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)[:24]
