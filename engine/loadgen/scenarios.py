"""Named load scenarios and an async runner over HTTP. Torch-free: `strata-engine bench scenario` and the
TUI's load action share it.

A scenario drives a running `strata-engine serve` through `/v1/completions` with prompts given as token ids
(the OpenAI spec allows arrays of ints), so a 150K-token prompt costs no client-side tokenizing. The vocab
size and the context per slot are read from `/v1/models` and `/strata/state`.

    result = await run_scenario("seed", "http://127.0.0.1:8000", on_progress=print, long_tokens=32000)
    result.ok, result.metrics["decode_ratio"], result.to_json()

Scenarios:
- `seed`: the user report (shared/seed): N concurrent short generations, then after `delay_s` one fresh long
  prompt (a random nonce at its start, so it is never cached) while they decode; by default the shorts decode
  until the long prompt is done and are then stopped (finish_reason "cancelled").
- `burst`: N concurrent short requests at once.
- `reuse`: the same long prompt twice, one after the other: the second should report cached prompt tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import secrets
import time
from typing import Any, Callable

import httpx

from engine.loadgen.load_client import LoadClient, RequestResult, ServerInfo, discover
from engine.errors import ConfigError
from engine.loadgen.scenario_types import Scenario, ScenarioParam, ScenarioProgress, ScenarioResult

__all__ = ["SCENARIOS", "Scenario", "ScenarioParam", "ScenarioProgress", "ScenarioResult", "get_scenario",
           "run_scenario", "scenario_names"]

ProgressCallback = Callable[["ScenarioProgress"], Any]

# Qwen-family vocabularies keep their special tokens at the top of the id range; random prompts stay below.
_SPECIAL_ID_FRACTION = 16
_NONCE_TOKENS = 16
_UNTIL_DONE_MAX_TOKENS = 8192  # a short's max_tokens when it runs until the long prompt is done, context unknown


class _Run:
    """One scenario in flight: makes prompts, sends requests, reports progress."""

    def __init__(self, scenario: Scenario, client: LoadClient, info: ServerInfo, params: dict[str, Any],
                 on_progress: ProgressCallback | None) -> None:
        self.scenario = scenario
        self.client = client
        self.info = info
        self.params = params
        self.on_progress = on_progress
        self.t0 = time.perf_counter()
        self.rng = random.Random(int(params.get("seed", 0)))
        self.results: list[RequestResult] = []
        self.total = 0
        self.notes: list[str] = []
        self.metrics: dict[str, float | None] = {}

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    async def report(self, event: str, message: str, label: str | None = None) -> None:
        if self.on_progress is None:
            return
        done = sum(1 for r in self.results if r.end_s is not None)
        progress = ScenarioProgress(self.scenario.name, event, message, self.elapsed_s(), label, done, self.total)
        outcome = self.on_progress(progress)
        if inspect.isawaitable(outcome):
            await outcome

    def prompt(self, n_tokens: int, fresh: bool = True) -> list[int]:
        """`n_tokens` ids below the special-token range; `fresh` puts a random nonce first so no cache matches."""
        upper = max(2, self.info.vocab_size - self.info.vocab_size // _SPECIAL_ID_FRACTION)
        ids = [self.rng.randrange(upper) for _ in range(n_tokens)]
        if fresh:
            nonce = random.Random(secrets.randbits(64))
            for i in range(min(_NONCE_TOKENS, n_tokens)):
                ids[i] = nonce.randrange(upper)
        return ids

    def check_fits(self, param: str, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ConfigError before anything is sent when a prompt cannot fit the engine's context."""
        context = self.info.context_tokens
        if context is not None and prompt_tokens + max_tokens > context:
            raise ConfigError(param, prompt_tokens,
                              f"with max_tokens={max_tokens} this needs {prompt_tokens + max_tokens} tokens but the "
                              f"engine's context is {context} tokens per slot; start it with --context "
                              f"{prompt_tokens + max_tokens} or more, or lower {param}")

    async def send(self, label: str, kind: str, prompt_ids: list[int], max_tokens: int,
                   ignore_eos: bool = False) -> RequestResult:
        """Stream one request, record it in the results and report each step of it."""
        result = RequestResult(label=label, kind=kind, prompt_tokens=len(prompt_ids), max_tokens=max_tokens,
                               start_s=self.elapsed_s())
        self.results.append(result)
        await self.report("sent", f"{label}: {len(prompt_ids)} prompt tokens, max_tokens={max_tokens}", label)

        async def first_token() -> None:
            await self.report("first_token", f"{label}: first token after {result.ttft_s:.2f} s", label)

        try:
            await self.client.complete(result, prompt_ids, max_tokens, float(self.params.get("temperature", 0.0)),
                                       self.t0, on_first_token=first_token,
                                       ignore_eos=ignore_eos or bool(self.params.get("ignore_eos", 0)))
        except asyncio.CancelledError:
            # The scenario stopped it on purpose (closing the stream makes the server abort the request).
            result.finish_reason = result.finish_reason or "cancelled"
            result.completion_tokens = result.completion_tokens or round(sum(n for _, n in result.increments))
            await self.report("finished", f"{label}: stopped by the scenario: {result.summary()}", label)
            raise
        if result.error:
            await self.report("failed", f"{label}: {result.error}", label)
        else:
            await self.report("finished", f"{label}: {result.summary()}", label)
        return result


# --- the scenarios ----------------------------------------------------------------------------------------


async def _play_seed(run: _Run, p: dict[str, Any]) -> None:
    n_short = int(p["concurrency"])
    short_prompt = int(p["short_prompt_tokens"])
    run.check_fits("long_tokens", int(p["long_tokens"]), int(p["long_max_tokens"]))
    # 0: the shorts decode until the long prompt is done, however fast the engine is, then are stopped
    until_long_done = int(p["short_max_tokens"]) == 0
    short_max = (run.info.context_tokens or _UNTIL_DONE_MAX_TOKENS) - short_prompt if until_long_done \
        else int(p["short_max_tokens"])
    run.check_fits("short_max_tokens", short_prompt, short_max)
    make_room = _shorts_to_stop(run, n_short, until_long_done)
    run.total = n_short + 1
    # Until-done shorts ignore EOS: one that drew EOS early would end and free its slot, and the long prompt
    # would no longer arrive while they decode.
    shorts = [asyncio.create_task(run.send(f"short-{i}", "short", run.prompt(short_prompt), short_max,
                                           ignore_eos=until_long_done))
              for i in range(n_short)]
    await asyncio.sleep(float(p["delay_s"]))
    for task in shorts[:make_room]:
        # Every slot holds a short that would decode until its context is full: the long prompt would wait
        # for that, not be admitted while the others decode. Stopping one frees the slot it takes.
        task.cancel()
    long_prompt = run.prompt(int(p["long_tokens"]), fresh=True)
    long = await run.send("long", "long", long_prompt, int(p["long_max_tokens"]))
    if until_long_done:
        for task in shorts:
            task.cancel()
    await asyncio.gather(*shorts, return_exceptions=True)
    if until_long_done and "ignore_eos" in run.client.refused_fields:
        run.notes.append("the server refused ignore_eos: the short generations stop at EOS, so one may have "
                         "ended before the long prompt was done")
    kept = [r for r in run.results if r.kind == "short"][make_room:]
    _seed_metrics(run, long, kept)


def _shorts_to_stop(run: _Run, n_short: int, until_long_done: bool) -> int:
    """How many shorts to stop when the long prompt is sent, so that it gets a slot while the rest decode."""
    if not until_long_done:
        return 0  # they end on their own
    slots = run.info.slots
    if slots is None:
        run.notes.append("the server does not report its slot count: if the short generations hold every slot, "
                         "the long prompt waits until one of them fills its context")
        return 0
    make_room = max(0, n_short - slots + 1)
    if make_room >= n_short:
        raise ConfigError("concurrency", n_short, f"the server has {slots} slot(s): with short_max_tokens=0 "
                          "no short generation could decode while the long prompt is admitted")
    if make_room:
        run.notes.append(f"{n_short} short generations fill the server's {slots} slots: {make_room} stopped when "
                         f"the long prompt was sent, so it is admitted while {n_short - make_room} decode")
    return make_room


def _seed_metrics(run: _Run, long: RequestResult, shorts: list[RequestResult]) -> None:
    """The decode rate of the shorts that kept decoding while the long prompt was admitted, relative to their
    rate before it."""
    firsts = [r.first_token_s for r in shorts if r.first_token_s is not None]
    before_start = max(firsts) if firsts else None
    during_end = long.first_token_s if long.first_token_s is not None else long.end_s
    before = _window_rate(shorts, before_start, long.start_s)
    during = _window_rate(shorts, long.start_s, during_end)
    run.metrics.update({
        "long_ttft_s": long.ttft_s,
        "short_decode_tok_s_before": before,
        "short_decode_tok_s_during_long_prefill": during,
        "decode_ratio": (during / before) if before and during is not None else None,
    })
    if during is None:
        run.notes.append("the short generations were not decoding while the long prompt was admitted; "
                         "raise short_max_tokens to measure the decode rate during its prefill")


def _window_rate(requests: list[RequestResult], start_s: float | None, end_s: float | None) -> float | None:
    """Summed tok/s of the requests that were decoding in [start_s, end_s], each over its own active span."""
    if start_s is None or end_s is None or end_s <= start_s:
        return None
    total = 0.0
    active = 0
    for r in requests:
        if r.first_token_s is None:
            continue
        span_start = max(start_s, r.first_token_s)
        span_end = min(end_s, r.end_s if r.end_s is not None else end_s)
        if span_end - span_start <= 1e-3:
            continue
        tokens = sum(n for t, n in r.increments if span_start < t <= span_end)
        total += tokens / (span_end - span_start)
        active += 1
    return total if active else None


async def _play_burst(run: _Run, p: dict[str, Any]) -> None:
    n = int(p["requests"])
    run.check_fits("prompt_tokens", int(p["prompt_tokens"]), int(p["max_tokens"]))
    run.total = n
    results = await asyncio.gather(*(
        run.send(f"burst-{i}", "short", run.prompt(int(p["prompt_tokens"])), int(p["max_tokens"])) for i in range(n)
    ))
    done = [r for r in results if not r.error]
    if done:
        tokens = sum(r.completion_tokens for r in done)
        span_s = max(r.end_s or 0.0 for r in done) - min(r.start_s for r in done)
        ttfts = sorted(r.ttft_s for r in done if r.ttft_s is not None)
        run.metrics.update({
            "aggregate_tok_s": tokens / span_s if span_s > 0 else None,
            "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
            "ttft_max_s": ttfts[-1] if ttfts else None,
        })


async def _play_reuse(run: _Run, p: dict[str, Any]) -> None:
    run.check_fits("long_tokens", int(p["long_tokens"]), int(p["max_tokens"]))
    run.total = 2
    prompt = run.prompt(int(p["long_tokens"]), fresh=True)
    first = await run.send("first", "long", prompt, int(p["max_tokens"]))
    second = await run.send("second", "long", prompt, int(p["max_tokens"]))
    run.metrics.update({
        "first_ttft_s": first.ttft_s,
        "second_ttft_s": second.ttft_s,
        "second_cached_tokens": float(second.cached_tokens),
        "ttft_speedup": (first.ttft_s / second.ttft_s) if first.ttft_s and second.ttft_s else None,
    })
    if not second.error and second.cached_tokens == 0:
        run.notes.append("the second request reported no cached prompt tokens: no prefix-cache hit")


_COMMON = (
    ScenarioParam("temperature", 0.0, "sampling temperature of every request (0: greedy)"),
    ScenarioParam("seed", 0, "seed of the random prompt filler (the long prompt's nonce is always fresh)"),
    ScenarioParam("ignore_eos", 0, "1: every request generates its max_tokens past EOS (vLLM's ignore_eos; the "
                                   "seed's until-done shorts always do)", maximum=1),
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("seed", "the user report: N short generations decode, then a fresh long prompt arrives", (
            ScenarioParam("concurrency", 6, "concurrent short generations"),
            ScenarioParam("short_prompt_tokens", 64, "prompt tokens of each short generation"),
            ScenarioParam("short_max_tokens", 0, "tokens each short generation produces "
                                                 "(0: decode until the long prompt is done, then stop)"),
            ScenarioParam("delay_s", 3.0, "seconds between the short generations and the long prompt"),
            ScenarioParam("long_tokens", 150_000, "prompt tokens of the fresh long prompt"),
            ScenarioParam("long_max_tokens", 16, "tokens the long prompt generates"),
        ) + _COMMON, _play_seed),
        Scenario("burst", "N concurrent short requests sent at once", (
            ScenarioParam("requests", 16, "concurrent requests"),
            ScenarioParam("prompt_tokens", 64, "prompt tokens of each request"),
            ScenarioParam("max_tokens", 128, "tokens each request produces"),
        ) + _COMMON, _play_burst),
        Scenario("reuse", "the same long prompt twice: the second should hit the prompt cache", (
            ScenarioParam("long_tokens", 32_000, "prompt tokens of the long prompt"),
            ScenarioParam("max_tokens", 16, "tokens each request produces"),
        ) + _COMMON, _play_reuse),
    )
}


def scenario_names() -> list[str]:
    """The registered scenario names, in registry order (for menus and --help)."""
    return list(SCENARIOS)


def get_scenario(name: str) -> Scenario:
    """Look a scenario up by name; an unknown name is a ConfigError listing the known ones."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ConfigError("scenario", name, f"unknown scenario; known: {', '.join(SCENARIOS)}") from None


async def run_scenario(
    name: str,
    base_url: str,
    api_key: str | None = None,
    *,
    on_progress: ProgressCallback | None = None,
    http_client: httpx.AsyncClient | None = None,
    timeout_s: float = 1800.0,
    **params: Any,
) -> ScenarioResult:
    """Play scenario `name` against the server at `base_url` and return what happened.

    `params` override the scenario's parameters (see `get_scenario(name).params`); `on_progress` (sync or
    async) receives a ScenarioProgress per step. Request failures (HTTP errors, a dropped connection when the
    engine dies) are recorded in the result, not raised; a bad parameter, an unreachable server or a prompt
    that cannot fit the engine's context raise ConfigError before anything is sent.
    """
    scenario = get_scenario(name)
    values = scenario.resolve(params)
    own_client = http_client is None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = http_client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
    try:
        load = LoadClient(client, base_url, headers)
        info = await discover(load)
        result = ScenarioResult(name, load.base_url, info.model, values, time.time(), health_before=info.health)
        run = _Run(scenario, load, info, values, on_progress)
        run.notes.extend(info.notes)
        await run.report("start", f"{name} against {load.base_url} ({info.model}, vocab {info.vocab_size}, "
                                  f"context {info.context_tokens or 'unknown'})")
        await scenario.play(run, values)
        result.wall_s = run.elapsed_s()
        result.requests, result.metrics, result.notes = run.results, run.metrics, run.notes
        result.health_after = await load.health()
        status = "ok" if result.ok else f"{len(result.errors)} error(s), health after: {result.health_after}"
        await run.report("done", f"{name} done in {result.wall_s:.1f} s: {status}")
        return result
    finally:
        if own_client:
            await client.aclose()
