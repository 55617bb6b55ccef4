"""`strata-engine bench profile`: where one steady decode step's time goes, host and device.

`--batch` requests decode (MTP verify + draft round with `--batch-mtp`) on the real Engine. After a warm-up
that captures every graph the timed steps need, four passes over `--steps` steps each:

1. wall: host wall time per `Engine.step()` (each returns with its tokens on the host, so a step boundary is a
   device sync): `step_ms` p50 and mean.
2. phases: host wall time per step split by what the engine does in it (engine.bench.phases: schedule,
   forward, sample, execute, update, detokenize, deliver, telemetry, the hand-over to the clients), per step
   and per decoding row (`section` phase); its timers cost a few us a step.
3. host: cProfile around the same steps: the functions with the most own time per step (`tottime`), so Python
   work around the replay (scheduling, staging, sampling, detokenization, telemetry) shows by name.
4. device: torch.profiler (CUDA activity on GPU): kernels launched per step, summed kernel time per step
   (`gpu_busy_ms`), and the kernels with the most time. `gpu_busy_ms / step_ms` says whether a step is bound by
   the device (near 1) or by the host (well below 1). The device's idle time between kernels is split by gap
   length: `gpu_short_gaps_ms` (gaps up to _LONG_GAP_US: one kernel waiting for the one before it, inside a graph
   replay or a stream of launches) and `gpu_long_gaps_ms` (longer: the device waiting for the host between
   replays, inflated by the profiler's own host cost), per step.

Rows are one entry per host function and per kernel (`section` host / device); the summary holds the per-step
figures. Passes 2 to 4 slow the host down, so only pass 1's `step_ms` is a speed figure.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from typing import Any

from engine.bench.common import device_of, emit, random_prompt
from engine.bench.engine_driver import BenchEngine, build_engine
from engine.bench.phases import phase_pass
from engine.model import pdl

_CONTEXT_MARGIN_TOKENS = 64
_LONG_GAP_US = 20.0  # longer than a dependent kernel's launch latency inside a replay; shorter than a step's host work


def _start(bench: BenchEngine, args: argparse.Namespace, tokens_needed: int) -> list[Any]:
    """Add the requests and step until every one decodes, then `warmup_steps` more (graph captures)."""
    vocab = bench.engine.lm.config.vocab_size
    reqs = [bench.add(random_prompt(args.prompt_tokens, vocab, seed=7000 + i), tokens_needed)
            for i in range(args.batch)]
    guard = args.prompt_tokens * args.batch + 1000
    while not all(r.num_output_tokens for r in reqs):
        bench.step()
        guard -= 1
        if guard <= 0:
            raise RuntimeError("the profile's requests never reached decode")
    for _ in range(max(args.warmup_steps, 8)):
        bench.step()
    return reqs


def host_functions(profile: cProfile.Profile) -> list[tuple[str, int, float, float]]:
    """(file:line:function, calls, own s, cumulative s) of every function a cProfile run saw."""
    return [(f"{os.path.basename(path)}:{line}:{name}", calls, tottime, cumtime)
            for (path, line, name), (_cc, calls, tottime, cumtime, _callers)
            in pstats.Stats(profile).stats.items()]  # type: ignore[attr-defined]


def _host_rows(profile: cProfile.Profile, steps: int, top: int) -> list[dict[str, Any]]:
    entries = [{"section": "host", "name": where, "calls_per_step": calls / steps,
                "own_us_per_step": tottime / steps * 1e6, "cum_us_per_step": cumtime / steps * 1e6}
               for where, calls, tottime, cumtime in host_functions(profile)]
    entries.sort(key=lambda e: e["own_us_per_step"], reverse=True)
    return entries[:top]


def _device_pass(bench: BenchEngine, steps: int, top: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Kernels per step and summed kernel time per step (CUDA), or CPU op time on CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            bench.step()
    totals: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for evt in prof.events():
        on_device = cuda and evt.device_type.name == "CUDA"
        if cuda and not on_device:
            continue
        if on_device:
            spans.append((evt.time_range.start, evt.time_range.end))
        if not cuda and evt.cpu_parent is not None:  # CPU: top-level ops only, no double counting
            continue
        us = evt.device_time if on_device else evt.cpu_time
        entry = totals.setdefault(evt.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    kernels = sum(n for n, _ in totals.values())
    busy_us = sum(us for _, us in totals.values())
    rows = [{"section": "device" if cuda else "cpu_ops", "name": name[:120], "calls_per_step": n / steps,
             "us_per_step": us / steps} for name, (n, us) in totals.items()]
    rows.sort(key=lambda r: r["us_per_step"], reverse=True)
    summary = {"kernels_per_step" if cuda else "top_level_ops_per_step": kernels / steps,
               "gpu_busy_ms" if cuda else "cpu_op_ms": busy_us / steps / 1e3}
    if cuda:
        short_us, long_us = gap_split_us(spans, _LONG_GAP_US)
        summary.update(gpu_short_gaps_ms=short_us / steps / 1e3, gpu_long_gaps_ms=long_us / steps / 1e3)
    return rows[:top], summary


def gap_split_us(spans: list[tuple[float, float]], long_gap_us: float) -> tuple[float, float]:
    """(sum of idle gaps up to `long_gap_us`, sum of longer ones) between kernels given as (start, end) in us.
    Overlapping kernels (several streams) leave no gap; the idle time is the device's, not a stream's."""
    short = long = 0.0
    busy_until = None
    for start, end in sorted(spans):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            if gap <= long_gap_us:
                short += gap
            else:
                long += gap
        busy_until = end if busy_until is None else max(busy_until, end)
    return short, long


def run(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    steps = args.steps
    # Every pass runs `steps` steps; with MTP a step can emit 1 + depth tokens per slot.
    per_step = 1 + (args.mtp_depth if args.batch_mtp else 0)
    tokens_needed = (4 * steps + 2 * max(args.warmup_steps, 8) + 16) * per_step
    bench = build_engine(args, batch=args.batch, context=args.prompt_tokens + tokens_needed + _CONTEXT_MARGIN_TOKENS)
    try:
        reqs = _start(bench, args, tokens_needed)
        wall_ms = []
        for _ in range(steps):
            t0 = time.perf_counter()
            bench.step()
            wall_ms.append((time.perf_counter() - t0) * 1e3)
        phase_rows, phase_summary = phase_pass(bench, reqs, steps)
        profiler = cProfile.Profile()
        profiler.enable()
        t0 = time.perf_counter()
        for _ in range(steps):
            bench.step()
        profiled_ms = (time.perf_counter() - t0) * 1e3 / steps
        profiler.disable()
        rows = _host_rows(profiler, steps, args.top)
        device_rows, device_summary = _device_pass(bench, steps, args.top)
        rows = phase_rows + rows + device_rows
        summary: dict[str, Any] = {
            "batch": args.batch, "mtp": bool(bench.engine.mtp_on), "graphs_active": bench.graphs_active,
            # steps launched before the step ahead of them was read (engine.exec.decode_ahead), over every pass
            "decode_ahead": bench.engine.ahead.enabled, "steps_taken_ahead": bench.engine.ahead.taken,
            "step_ms_p50": statistics.median(wall_ms), "step_ms_mean": statistics.fmean(wall_ms),
            "step_ms_under_cprofile": profiled_ms, **phase_summary, **device_summary,
            "pdl": bool(pdl.launch_kwargs()),  # as the engine ran: an A/B by STRATA_PDL shows what it toggled
        }
        if "gpu_busy_ms" in summary:
            summary["gpu_busy_fraction"] = summary["gpu_busy_ms"] / summary["step_ms_p50"]
    finally:
        bench.close()
    emit(args, "profile", rows, summary, device,
         ("section", "name", "calls_per_step", "own_us_per_step", "cum_us_per_step", "us_per_step", "us_per_row"))
    return 0
