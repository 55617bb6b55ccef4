"""The app's I/O, each piece a worker body: the engine process, the state reads, the liveness probe, NVML
sampling and the load scenario (the event stream's is `telemetry_client.stream_telemetry`, beside its read
loop). They report by calling `post` (the app's post_message) and never touch widgets or the app, so each
can be run and tested on its own; the app starts each with `run_worker` in its own group.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import httpx
from textual.worker import get_current_worker

from engine.snapshot import ExpertCacheSnapshot, KvSnapshot, QueueSnapshot
from strata_tui.gpu import NvmlSampler
from strata_tui.launcher import EngineProcess
from strata_tui.messages import (
    EngineExited,
    EngineLiveness,
    EngineOutput,
    EngineReady,
    ExpertsSnapshot,
    KvPoolSnapshot,
    GpuSampled,
    LoadProgress,
    StateSnapshot,
)
from strata_tui.telemetry_client import Post, TelemetryClient

# A stop is seen within LIVENESS_SILENCE_S: each probe may take what is left of that since the last answer,
# so a probe every 0.25 s (not every 0.1 s: each costs the app a few milliseconds of CPU, most of its idle
# cost) still notices a stopped engine as soon as a faster probe would. An engine busy with a long chunk
# answers /health in time (the server's event loop answers it from the health the engine thread keeps, and
# its access lines are DEBUG).
LIVENESS_INTERVAL_S = 0.25
LIVENESS_SILENCE_S = 0.85


async def run_engine(post: Post, process: EngineProcess, run: int) -> None:
    """Run one engine process to its end and report how it ended. Cancelling the worker stops it.

    The process was built with `engine_callbacks(post, run)`, so its output and ready line arrive as messages."""
    try:
        info = await process.run()
    except (OSError, ValueError) as exc:  # the program is missing or not executable
        post(EngineExited(-1, False, f"could not start {process.argv[0]}: {exc}", run))
        return
    post(EngineExited(info.returncode, info.requested, None, run))


def engine_callbacks(post: Post, run: int) -> dict[str, Any]:
    """`on_output` / `on_ready` for an EngineProcess that post EngineOutput / EngineReady to the app."""

    def on_output(stream: str, lines: list[str]) -> None:
        post(EngineOutput([(stream, line) for line in lines], run))

    def on_ready(url: str) -> None:
        post(EngineReady(url, run))

    return {"on_output": on_output, "on_ready": on_ready}


async def read_state(post: Post, client: TelemetryClient) -> None:
    """Read `/strata/state` once and post it (the engine answers again after a gap: it may be another one)."""
    try:
        post(StateSnapshot(await client.state()))
    except (httpx.HTTPError, OSError, ValueError):
        pass  # the liveness probe and the event stream report an engine that does not answer


async def poll_state(post: Post, client: TelemetryClient, interval_s: float = 1.0,
                     dense_interval_s: float = 10.0, busy: Callable[[], bool] = lambda: True) -> None:
    """Read `/strata/state` every `interval_s` while the engine has an expert cache, or requests running (`busy`;
    once more after the last ends, for the blocks it gave back), and post those sections (hit counters, pool use
    and the queue's depth change every step but travel in no event); otherwise only every `dense_interval_s` (an
    idle engine does not change; a restarted engine may have either). Reads never overlap."""
    fast, was_busy, last_read_s = False, False, float("-inf")
    while True:
        now_busy = busy()
        if not (fast and (now_busy or was_busy)) and time.monotonic() - last_read_s < dense_interval_s:
            await asyncio.sleep(interval_s)  # nothing to read yet: no request to the engine
            continue
        was_busy = now_busy
        started = last_read_s = time.monotonic()
        state: dict = {}
        try:
            answer = await client.state()
            state = answer if isinstance(answer, dict) else {}
        except (httpx.HTTPError, OSError, ValueError):
            pass  # the liveness probe and the event stream report an engine that does not answer
        # Only the sections read here are parsed (typed, as EngineSnapshot parses them): the slots, which the event
        # stream carries, would cost a parse of every slot each second.
        experts = ExpertCacheSnapshot.from_json(state["experts"]) if isinstance(state.get("experts"), dict) else None
        kv = KvSnapshot.from_json(state["kv"]) if isinstance(state.get("kv"), dict) else None
        paging = kv.paging if kv is not None else None
        if experts is not None:
            post(ExpertsSnapshot(experts))
        if state:
            queue = QueueSnapshot.from_json(state.get("queue"))
            post(KvPoolSnapshot(paging, queue.admission_wait, queue.waiting))
        fast = True  # the queue's depth (and a pool's use) is read once a second while requests run
        if experts is not None:  # the expert panel is kept current once a second, busy or not
            fast, was_busy = True, True
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def watch_liveness(post: Post, client: TelemetryClient, interval_s: float = LIVENESS_INTERVAL_S,
                         silence_s: float = LIVENESS_SILENCE_S) -> None:
    """Ask /health every `interval_s`: an engine that stops answering, even with its connections open
    (stopped, swapping, wedged), is reported `silence_s` after its last answer at the latest. Its event
    stream can stay silent for many seconds when idle, so the stream alone cannot tell; but bytes on the
    stream are an answer too: while a busy engine's events keep coming, no probe is sent (a probe costs the
    app more CPU than a read of the stream does)."""
    answering: bool | None = None
    last_answer_s = time.monotonic()
    while True:
        started = time.monotonic()
        heard_s = client.last_data_s
        if answering and heard_s is not None and started - heard_s < interval_s:
            last_answer_s = max(last_answer_s, heard_s)
            await asyncio.sleep(interval_s)
            continue
        # While it answers, a probe may take what is left of the silence allowed since the last answer.
        budget_s = max(0.05, last_answer_s + silence_s - started) if answering else silence_s
        try:
            await client.health(timeout_s=budget_s)
            now, reason = True, "answering"
            last_answer_s = time.monotonic()
        except (httpx.HTTPError, OSError) as exc:
            now, reason = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if now != answering:
            answering = now
            post(EngineLiveness(now, reason))
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def sample_gpus(post: Post, interval_s: float, sampler: NvmlSampler) -> None:
    """Thread worker: NVML calls block, so they run here, one reading of every GPU per interval."""
    worker = get_current_worker()
    reason = sampler.open()
    if reason is not None:
        post(GpuSampled([], reason))
        return
    try:
        while not worker.is_cancelled:
            post(GpuSampled(sampler.sample()))
            deadline = time.monotonic() + interval_s
            while time.monotonic() < deadline and not worker.is_cancelled:
                time.sleep(min(0.1, interval_s))
    finally:
        sampler.close()


async def run_load(post: Post, name: str, base_url: str, api_key: str | None, params: dict[str, Any]) -> None:
    """Play a named scenario from engine.loadgen.scenarios against the running engine, reporting progress."""
    from engine.loadgen import scenarios  # torch-free; imported here so a missing bench part only disables this

    def progress(step: Any) -> None:
        post(LoadProgress(f"{step.scenario}: {step.message}"))

    try:
        result = await scenarios.run_scenario(name, base_url, api_key, on_progress=progress, **params)
    except Exception as exc:  # ConfigError (does not fit), an unreachable engine: say it, keep the app
        post(LoadProgress(f"load {name}: {type(exc).__name__}: {exc}", done=True, failed=True))
        return
    post(LoadProgress(scenario_report(result), done=True, failed=not result.ok))


def scenario_report(result: Any) -> str:
    """A scenario's result as lines for its panel: the verdict, then one metric per line; counts as whole
    numbers with separators (never 1.2e+04), times and rates with two decimals."""
    summary = "ok" if result.ok else "; ".join(result.errors[:3]) or f"health after: {result.health_after}"
    lines = [f"load {result.name} done in {result.wall_s:.1f} s: {summary}"]
    width = max((len(key) for key in result.metrics), default=0)
    for key, value in result.metrics.items():
        lines.append(f"  {key:<{width}}  {format_metric(key, value)}")
    lines.extend(f"  note: {note}" for note in getattr(result, "notes", [])[:5])
    return "\n".join(lines)


def format_metric(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (float(value).is_integer() and not key.endswith(("_s", "_ms"))):
        return f"{int(value):,}"
    return f"{value:,.2f}"
