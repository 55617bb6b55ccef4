"""Real engines for the server tests: a random tiny checkpoint, the real AsyncEngine on CPU, a live uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai

from engine.config import EngineConfig
from engine.server.app import create_app
from tests.engine.server.live import LiveServer

_CHECKPOINTS: dict[str, Path] = {}


def random_checkpoint(root: Path) -> Path:
    """One random tiny Qwen3 checkpoint per test session (written once: a tenth of a second, but why twice)."""
    from engine.model.random_checkpoint import write_random_checkpoint

    key = str(root)
    if key not in _CHECKPOINTS:
        _CHECKPOINTS[key] = write_random_checkpoint(root / "tiny-qwen3")
    return _CHECKPOINTS[key]


@contextlib.contextmanager
def real_server(model: str, **overrides: Any) -> Iterator[tuple[str, Any, EngineConfig]]:
    """Yield (base URL, engine client, config) for a real AsyncEngine on CPU behind a live server."""
    from engine.orchestration.async_engine import AsyncEngine

    config = EngineConfig(model=model, device="cpu", **overrides)
    client = AsyncEngine(config)
    try:
        with LiveServer(create_app(client, config)) as url:
            assert wait_until(lambda: client.health().ready, timeout_s=120), client.health().reason
            yield url, client, config
    finally:
        asyncio.run(client.shutdown())


def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def busy_slots(url: str) -> tuple[int, int]:
    """(slots not idle, requests waiting) from /strata/state."""
    state = httpx.get(url + "/strata/state", timeout=5).json()
    busy = sum(1 for s in state["slots"] if s.get("state") not in ("idle", None))
    return busy, int(state["queue"]["waiting"])


def openai_client(url: str) -> openai.OpenAI:
    """The official client against a live server's /v1, no retries (a retry would hide the first answer)."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
