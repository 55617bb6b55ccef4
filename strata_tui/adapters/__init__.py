"""Adapters for engines other than Strata: each maps one engine's routes and Prometheus metrics onto the same
`EndpointView` the monitor draws (strata_tui/adapters/view.py). `detect()` tells which engine answers at a URL."""

from __future__ import annotations

import json

import httpx

from strata_tui.adapters.base import Adapter, TooLarge, fetch
from strata_tui.adapters.llamacpp import LlamacppAdapter
from strata_tui.adapters.sglang import SglangAdapter
from strata_tui.adapters.strata import StrataAdapter
from strata_tui.adapters.vllm import VllmAdapter

ADAPTERS: dict[str, type[Adapter]] = {"strata": StrataAdapter, "vllm": VllmAdapter, "sglang": SglangAdapter,
                                      "llamacpp": LlamacppAdapter}


def adapter_for(kind: str, url: str) -> Adapter:
    return ADAPTERS[kind](url)


async def detect(client: httpx.AsyncClient) -> str | None:
    """Which engine answers: Strata's /strata/state, llama.cpp's /props (with slots), SGLang's /get_server_info,
    vLLM's /version beside `vllm:` metrics. None when none of them does (the caller names what was tried)."""

    async def answers(path: str) -> bytes | None:
        try:
            status, body = await fetch(client, path)  # at most MAX_BODY_BYTES of whatever answers
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise  # nothing answers there at all: the caller says why (connection refused), not "none of these"
        except TooLarge:
            # It answers that route, with more than is read: Strata's state route says which engine by its path
            # (its reader then says the state is too large); the others are told by their bodies, and this has none.
            return b""
        except (httpx.HTTPError, ValueError):
            return None
        return body if status == 200 else None

    if await answers("/strata/state") is not None:
        return "strata"
    props = await answers("/props")
    if props is not None and _json_has(props, ("total_slots", "default_generation_settings")):
        return "llamacpp"
    info = await answers("/get_server_info")
    if info is not None and _json_has(info, ("model_path", "tp_size", "version")):
        return "sglang"
    version = await answers("/version")
    if version is not None and _json_has(version, ("version",)):
        metrics = await answers("/metrics")
        if metrics is not None and b"vllm:" in metrics:
            return "vllm"
    return None


def _json_has(body: bytes, keys: tuple[str, ...]) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and any(k in data for k in keys)
