"""The app's I/O, each piece a worker body: the engine process, the state reads, the liveness probe, NVML
sampling and the load scenario (the event stream's is `telemetry_client.stream_telemetry`, beside its read
loop). They report by calling `post` (the app's post_message) and never touch widgets or the app, so each
can be run and tested on its own; the app starts each with `run_worker` in its own group.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Callable

import httpx
from textual.worker import get_current_worker

from engine.snapshot import ExpertCacheSnapshot, KvSnapshot, QueueSnapshot
from strata_tui.engine_io.gpu import NvmlSampler
from strata_tui.engine_io.http_errors import describe_http_error, plain_error
from strata_tui.engine_io.launcher import EngineProcess
from strata_tui.engine_io.messages import (
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
from strata_tui.engine_io.telemetry_client import Post, TelemetryClient

# A stop is seen within LIVENESS_SILENCE_S: each probe may take what is left of that since the last answer,
# so probes 0.25-0.5 s apart (not every 0.1 s: each costs the app a few milliseconds of CPU, most of its idle
# cost) still notice a stopped engine as soon as a faster probe would. An engine busy with a long chunk
# answers /health in time (the server's event loop answers it from the health the engine thread keeps, and
# its access lines are DEBUG).
LIVENESS_INTERVAL_S = 0.25
LIVENESS_SILENCE_S = 0.85
# What a probe is left to answer in, at the least, when the gap between probes is stretched: an engine that
# answers in milliseconds is asked every 0.5 s (half the probes of an idle app), one whose answers take longer
# (a loaded machine) is asked more often so that each probe keeps four times its slowest recent answer.
PROBE_BUDGET_S = 0.35
_ANSWERS_KEPT = 8


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
    app more CPU than a read of the stream does). While it answers promptly, probes are PROBE_BUDGET_S short of
    `silence_s` apart (the last may take that long), down to `interval_s` when its answers are slow."""
    answering: bool | None = None
    last_answer_s = time.monotonic()
    answer_times_s: deque[float] = deque(maxlen=_ANSWERS_KEPT)
    while True:
        started = time.monotonic()
        heard_s = client.last_data_s
        if answering and heard_s is not None:
            last_answer_s = max(last_answer_s, heard_s)
        # While it answers, the next probe is due a gap after the last answer (a probe or bytes on the stream);
        # while it does not, every interval_s.
        gap_s = interval_s
        if answering:
            slowest_s = max(answer_times_s, default=0.0)
            gap_s = max(interval_s, silence_s - max(PROBE_BUDGET_S, 4 * slowest_s))
        if answering and started - last_answer_s < gap_s:
            await asyncio.sleep(min(gap_s, last_answer_s + gap_s - started))
            continue
        # While it answers, a probe may take what is left of the silence allowed since the last answer.
        budget_s = max(0.05, last_answer_s + silence_s - started) if answering else silence_s
        try:
            await client.health(timeout_s=budget_s)
            now, reason = True, "answering"
            last_answer_s = time.monotonic()
            answer_times_s.append(last_answer_s - started)
        except (httpx.HTTPError, OSError) as exc:
            now, reason = False, describe_http_error(exc)
        if now != answering:
            answering = now
            post(EngineLiveness(now, reason, time.time()))
        if not now:
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


async def run_load(post: Post, name: str, base_url: str, api_key: str | None, params: dict[str, Any],
                   kind: str = "strata") -> None:
    """Play a named scenario from engine.loadgen.scenarios against the running engine, reporting progress."""
    from engine.loadgen import scenarios  # torch-free; imported here so a missing bench part only disables this

    def progress(step: Any) -> None:
        post(LoadProgress(plain_error(f"{step.scenario}: {step.message}")))

    try:
        params = await fit_to_server(name, base_url, api_key, params, kind)
        result = await scenarios.run_scenario(name, base_url, api_key, on_progress=progress, **params)
    except Exception as exc:  # ConfigError (does not fit), an unreachable engine: say it, keep the app
        post(LoadProgress(plain_error(f"load {name}: {type(exc).__name__}: {exc}"), done=True, failed=True))
        return
    post(LoadProgress(scenario_report(result), done=True, failed=not result.ok))


# How to give each engine kind more context per request, for the advice when a scenario's prompt cannot fit.
CONTEXT_ADVICE = {"strata": "start it with --context {need} or more",
                  "vllm": "start it with --max-model-len {need} or more",
                  "sglang": "start it with --context-length {need} or more",
                  "llamacpp": "start it with -c (ctx_size) of at least {need} per slot (-c is shared by the -np "
                              "slots: -np 4 needs -c {need4})"}
MIN_LONG_TOKENS = 256  # a long prompt shorter than this measures nothing the short ones do not


async def fit_to_server(name: str, base_url: str, api_key: str | None, params: dict[str, Any],
                        kind: str) -> dict[str, Any]:
    """The seed and reuse scenarios' long prompt fitted to the context the server itself reports (not to a local
    profile: an attached engine, or another kind, has its own), so `l` fits whatever answers; a context too
    small for any long prompt raises ConfigError with that engine kind's own flag."""
    if name not in ("seed", "reuse") or "long_tokens" in params:
        return params
    from engine.errors import ConfigError
    from engine.loadgen.load_client import LoadClient, discover
    from engine.loadgen.scenarios import get_scenario

    defaults = {p.name: p.default for p in get_scenario(name).params}
    max_tokens = int(defaults.get("long_max_tokens", defaults.get("max_tokens", 16)))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0)) as client:
        info = await discover(LoadClient(client, base_url, headers))
    if info.context_tokens is None:
        return params  # the scenario's own default; its check says what does not fit
    room = info.context_tokens - max_tokens
    if room < MIN_LONG_TOKENS:
        need = MIN_LONG_TOKENS + max_tokens
        advice = CONTEXT_ADVICE.get(kind, CONTEXT_ADVICE["strata"]).format(need=need, need4=need * 4)
        raise ConfigError("long_tokens", room, f"the server's context is {info.context_tokens} tokens per request: "
                          f"no room for a long prompt of {MIN_LONG_TOKENS} tokens and {max_tokens} to generate; "
                          f"{advice}")
    return {**params, "long_tokens": int(min(defaults["long_tokens"], room))}


def scenario_report(result: Any) -> str:
    """A scenario's result as lines for its panel: the verdict, then one metric per line; counts as whole
    numbers with separators (never 1.2e+04), times and rates with two decimals; a metric the run could not
    measure says why."""
    summary = "ok" if result.ok else "; ".join(result.errors[:3]) or f"health after: {result.health_after}"
    lines = [plain_error(f"load {result.name} done in {result.wall_s:.1f} s: {summary}")]
    width = max((len(key) for key in result.metrics), default=0)
    for key, value in result.metrics.items():
        shown = format_metric(key, value)
        if value is None:
            shown += f" ({NOT_MEASURED.get(key, 'the run gave nothing to measure it from')})"
        lines.append(f"  {key:<{width}}  {shown}")
    lines.extend(f"  note: {plain_error(note)}" for note in getattr(result, "notes", [])[:5])
    return "\n".join(lines)


# Why a scenario's metric can be missing (engine.loadgen.scenarios computes them).
NOT_MEASURED = {
    "long_ttft_s": "the long prompt got no first token: see its error above",
    "short_decode_tok_s_before": "no short generation was decoding before the long prompt was sent",
    "short_decode_tok_s_during_long_prefill": "no short generation decoded while the long prompt was prefilled",
    "decode_ratio": "needs both short decode rates, before and during the long prefill",
    "aggregate_tok_s": "no request finished",
    "ttft_p50_s": "no request got a first token",
    "ttft_max_s": "no request got a first token",
    "first_ttft_s": "the first request got no first token",
    "second_ttft_s": "the second request got no first token",
    "ttft_speedup": "needs both requests' time to first token",
}


def format_metric(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (float(value).is_integer() and not key.endswith(("_s", "_ms"))):
        return f"{int(value):,}"
    return f"{value:,.2f}"
