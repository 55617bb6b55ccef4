"""The app's I/O, each piece a worker body: the engine process, the telemetry stream, NVML sampling, the
load scenario and the control routes. They post messages up to the app and never touch widgets.

These are plain functions taking the app (the node that owns the workers) so app.py stays about
wiring; each is started with `app.run_worker(...)` in its own group.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import httpx
from textual.worker import get_current_worker

from strata_tui.gpu import NvmlSampler
from strata_tui.launcher import EngineProcess
from strata_tui.messages import (
    EngineExited,
    EngineOutput,
    EngineReady,
    GpuSampled,
    LoadProgress,
    StateSnapshot,
    TelemetryBatch,
    TelemetryStatus,
)
from strata_tui.telemetry_client import TelemetryClient

if TYPE_CHECKING:
    from strata_tui.app import StrataApp


async def run_engine(app: "StrataApp", process: EngineProcess, run: int) -> None:
    """Run one engine process to its end and report how it ended. Cancelling the worker stops it.

    The process was built with `engine_callbacks(app)`, so its output and ready line arrive as messages."""
    try:
        info = await process.run()
    except (OSError, ValueError) as exc:  # the program is missing or not executable
        app.post_message(EngineExited(-1, False, f"could not start {process.argv[0]}: {exc}", run))
        return
    app.post_message(EngineExited(info.returncode, info.requested, None, run))


def engine_callbacks(app: "StrataApp", run: int) -> dict[str, Any]:
    """`on_output` / `on_ready` for an EngineProcess that post EngineOutput / EngineReady to the app."""

    def on_output(stream: str, lines: list[str]) -> None:
        app.post_message(EngineOutput([(stream, line) for line in lines], run))

    def on_ready(url: str) -> None:
        app.post_message(EngineReady(url, run))

    return {"on_output": on_output, "on_ready": on_ready}


async def stream_telemetry(app: "StrataApp", client: TelemetryClient) -> None:
    """Seed from /strata/state, then follow /strata/events (reconnecting) until cancelled."""

    def on_status(connected: bool, reason: str) -> None:
        app.post_message(TelemetryStatus(connected, reason))

    try:
        delay_s = 0.2
        while True:
            try:
                app.post_message(StateSnapshot(await client.state()))
                break
            except (httpx.HTTPError, ValueError) as exc:
                on_status(False, f"state: {type(exc).__name__}: {exc}")
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 2.0)
        async for batch in client.events(on_status):
            app.post_message(TelemetryBatch(batch))
    finally:
        await client.aclose()


def sample_gpus(app: "StrataApp", interval_s: float, sampler: NvmlSampler) -> None:
    """Thread worker: NVML calls block, so they run here, one reading of every GPU per interval."""
    worker = get_current_worker()
    reason = sampler.open()
    if reason is not None:
        app.post_message(GpuSampled([], reason))
        return
    try:
        while not worker.is_cancelled:
            app.post_message(GpuSampled(sampler.sample()))
            deadline = time.monotonic() + interval_s
            while time.monotonic() < deadline and not worker.is_cancelled:
                time.sleep(min(0.1, interval_s))
    finally:
        sampler.close()


async def run_load(app: "StrataApp", name: str, base_url: str, api_key: str | None, params: dict[str, Any]) -> None:
    """Play a named scenario from engine.loadgen.scenarios against the running engine, reporting progress."""
    from engine.loadgen import scenarios  # torch-free; imported here so a missing bench part only disables this

    def progress(step: Any) -> None:
        app.post_message(LoadProgress(f"{step.scenario}: {step.message}"))

    try:
        result = await scenarios.run_scenario(name, base_url, api_key, on_progress=progress, **params)
    except Exception as exc:  # ConfigError (does not fit), an unreachable engine: say it, keep the app
        app.post_message(LoadProgress(f"load {name}: {type(exc).__name__}: {exc}", done=True, failed=True))
        return
    summary = "ok" if result.ok else "; ".join(result.errors[:3]) or f"health after: {result.health_after}"
    metrics = ", ".join(f"{k}={v:.3g}" for k, v in result.metrics.items() if isinstance(v, (int, float)))
    app.post_message(LoadProgress(f"load {name} done in {result.wall_s:.1f} s: {summary}"
                                  + (f" ({metrics})" if metrics else ""), done=True, failed=not result.ok))
