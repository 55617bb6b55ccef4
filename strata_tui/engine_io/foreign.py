"""The app's side of engines other than Strata: messages and worker bodies for detecting which engine answers,
waiting for a launched one's health route, and reading every endpoint on its own loop (one unreachable node
is marked while the others keep updating). Like strata_tui/engine_io/workers.py, the bodies only call `post`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
from textual.message import Message

from strata_tui.adapters import adapter_for, detect
from strata_tui.adapters.base import READING, TooLarge
from strata_tui.adapters.view import EndpointView, ForeignView
from strata_tui.engine_io.http_errors import describe_http_error
from strata_tui.engine_io.launcher import EngineProcess
from strata_tui.engine_io.messages import EngineNews

Post = Callable[[Any], Any]
READ_INTERVAL_S = 1.0
READ_TIMEOUT_S = 2.0  # httpx's: connecting, and each wait for bytes
READ_DEADLINE_S = 5.0  # one whole reading (every route it asks): a server that trickles never trips the above
READY_POLL_S = 0.25


@dataclass
class EndpointRead(EngineNews):
    """One endpoint's latest reading (or failure); `index` is its row. Folded in by the reducer, as every engine's
    news is."""

    index: int
    view: EndpointView


@dataclass
class KindsDetected(Message):
    """What answers at each attached URL: a kind, or None with what was tried (`reasons`, same order)."""

    kinds: list[str | None]
    reasons: list[str]


def split_urls(text: str) -> list[str]:
    """`--attach URL[,URL...]`: several servers (data-parallel replicas, other hosts, other kinds), one row each."""
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _detect_one(url: str, api_key: str | None, timeout_s: float, deadline_s: float) -> tuple[str | None, str]:
    try:
        async with asyncio.timeout(deadline_s):  # a server that trickles never trips a read timeout
            async with httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=_headers(api_key)) as client:
                kind = await detect(client)
    except (httpx.HTTPError, TimeoutError) as exc:
        return None, f"{url}: {failure_reason(exc, deadline_s)}"
    why = "" if kind else (f"{url} answers none of /strata/state, /props (llama.cpp), /get_server_info (SGLang), "
                           "/version with vllm: metrics (vLLM): say which with --kind")
    return kind, why


async def detect_kinds(post: Post, urls: list[str], api_key: str | None = None, timeout_s: float = 3.0,
                       deadline_s: float = 4 * READ_DEADLINE_S) -> None:
    """Which engine answers at each URL, all at once (a Strata engine and a vLLM server may be watched side by
    side), each within `deadline_s`; one message with every answer."""
    found = await asyncio.gather(*(_detect_one(url, api_key, timeout_s, deadline_s) for url in urls))
    post(KindsDetected([kind for kind, _ in found], [why for _, why in found]))


async def wait_ready(post: Post, process: EngineProcess, url: str, health_path: str, run: int,
                     make_message: Callable[[str, int], Message]) -> None:
    """Ask the engine's health route until it answers 200 (llama.cpp answers 503 while loading), then post
    the ready message; gives up when the process ends."""
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
        while True:
            await asyncio.sleep(READY_POLL_S)
            if process.pid is not None and not process.running:
                return
            try:  # its status only (the body is not read), within a deadline (a head may trickle)
                async with asyncio.timeout(READ_DEADLINE_S), client.stream("GET", health_path) as response:
                    status = response.status_code
            except (httpx.HTTPError, TimeoutError):
                continue
            if status == 200:
                process.ready_url = url
                post(make_message(url, run))
                return


async def poll_endpoint(post: Post, kind: str, index: int, url: str, api_key: str | None = None,
                        interval_s: float = READ_INTERVAL_S, timeout_s: float = READ_TIMEOUT_S,
                        deadline_s: float = READ_DEADLINE_S) -> None:
    """Read one endpoint every `interval_s` until cancelled, each reading within `deadline_s`. A failure posts
    a view with nothing but the failure, in words (no values carried over), and the time it began."""
    adapter = adapter_for(kind, url)
    since: float | None = None
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=_headers(api_key)) as client:
        while True:
            started = time.monotonic()
            try:
                async with asyncio.timeout(deadline_s):
                    view = await adapter.read(client)
                since = None
            except Exception as exc:  # noqa: BLE001 - whatever a server's answer trips is said on its row
                since = since or time.time()
                view = EndpointView(url, kind, reachable=False, error=failure_reason(exc, deadline_s)[:160],
                                    unreachable_since=since)
            post(EndpointRead(index, view))
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def failure_reason(exc: BaseException, deadline_s: float) -> str:
    """Why a reading failed, in a line: the route it was reading and what went wrong ("connection refused"
    rather than httpx's words, where the OS gave a reason)."""
    route = READING.get()
    if isinstance(exc, TimeoutError):
        return f"no whole answer from {route or 'the server'} in {deadline_s:.0f} s"
    if isinstance(exc, TooLarge):
        text = str(exc)
    elif isinstance(exc, (httpx.HTTPError, OSError)):
        text = describe_http_error(exc)
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"{route}: {text}" if route and route not in text else text


def empty_view(kind: str, urls: list[str], kinds: list[str | None] | None = None,
               reasons: list[str] | None = None) -> ForeignView:
    """Rows for `urls` before their first reading; a URL whose kind was not detected says why in its row."""
    kinds = kinds or [kind] * len(urls)
    reasons = reasons or [""] * len(urls)
    return ForeignView(kind, [EndpointView(u, k or "?", error="not read yet" if k else f"not detected: {why}")
                              for u, k, why in zip(urls, kinds, reasons)])
