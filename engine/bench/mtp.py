"""`strata-engine bench mtp`: MTP speculative drafting on vs off on the same engine options and prompts.

Per batch size: decode tok/s without drafting and with `--batch-mtp --mtp-depth K`, the acceptance rate of
each draft position, and the tokens each slot gains per decode step. Greedy sampling, so both runs emit the
same tokens (`same_tokens` checks it) and the speedup is the drafting's alone. Acceptance only means something
on trained weights and in-distribution text: the default model is the built-in strata-tiny (trained on Python
source) and the prompts are windows of its shipped held-out sample, through its tokenizer.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
import time
from pathlib import Path
from typing import Any

from engine.bench.common import current_cpu, device_of, emit, event_counts, host_probe_us, random_prompt, sm_clock_mhz
from engine.bench.engine_driver import BenchEngine, build_engine, generate_all

TARGET_SPEEDUP_B1 = 1.5
_CONTEXT_MARGIN_TOKENS = 64
# strata-tiny ships a held-out sample of its training distribution (Python source); acceptance is measured on it.
_HELDOUT_FILE = "heldout_sample.txt"


def prompt_text(model_dir: Path) -> str:
    """The model's held-out sample when it ships one, else Python source from the standard library."""
    sample = model_dir / _HELDOUT_FILE
    if sample.is_file():
        return sample.read_text(encoding="utf-8", errors="replace")
    return Path(textwrap.__file__).read_text(encoding="utf-8")


def prompts_for(bench: BenchEngine, source: str, batch: int, n_tokens: int) -> list[list[int]]:
    """`batch` prompts of exactly `n_tokens`: windows of real text through the tokenizer, or random ids."""
    vocab = bench.engine.lm.config.vocab_size
    tokenizer = bench.engine.tokenizer
    if source == "random" or tokenizer is None:
        return [random_prompt(n_tokens, vocab, seed=i) for i in range(batch)]
    ids = tokenizer.encode(prompt_text(Path(bench.engine.lm.path)))
    stride = max(1, (len(ids) - n_tokens) // max(1, batch))
    while len(ids) < n_tokens + stride * batch:  # a short text is repeated rather than padded
        ids = ids + ids
    return [ids[i * stride: i * stride + n_tokens] for i in range(batch)]


# Two engines cannot live at once on CUDA (the first one's KV pool and tier take the free VRAM), so each mode's
# engine is built twice, in the order off, on, on, off: a drift of the machine over the run weighs on both modes
# alike (a batch-1 step of a tiny model is a fraction of a millisecond and one run moves a lot from the next).
_VISITS = (False, True, True, False)


def _row(args: argparse.Namespace, mtp: bool, mtp_active: bool, batch: int, runs: list) -> dict[str, Any]:
    rates = [r.decode_tok_s for r in runs]
    stats = runs[0]
    acceptance = stats.acceptance_per_position
    return {
        "mtp": "on" if mtp else "off", "depth": args.mtp_depth if mtp else 0, "batch": batch,
        "decode_tok_s": statistics.median(rates), "decode_tok_s_min": min(rates), "decode_tok_s_max": max(rates),
        "tokens_per_step": stats.tokens_per_step,
        "acceptance": [None if a is None else round(a, 4) for a in acceptance],
        "mtp_active": mtp_active, "steps": stats.steps,
        "same_tokens_each_run": all(r.token_ids == stats.token_ids for r in runs),
    }


def _warm_up(bench: BenchEngine, prompts: list[list[int]], args: argparse.Namespace) -> int:
    """Untimed runs: one that captures every bucket, then more until `--warmup-s` seconds and `--warmup-steps`
    engine steps have passed. Returns the runs made."""
    start_s, runs, steps = time.perf_counter(), 0, 0
    while runs == 0 or time.perf_counter() - start_s < args.warmup_s or steps < args.warmup_steps:
        steps += generate_all(bench, prompts, args.new_tokens).steps
        runs += 1
    return runs


def _timed_runs(bench: BenchEngine, prompts: list[list[int]], args: argparse.Namespace, count: int,
                visit: int) -> tuple[list, dict[str, Any]]:
    """`count` timed runs, and what the visit's record keeps of them: each run's rate, the device's SM clock after
    it and how fast the host ran then (`host_probe`: µs of a fixed piece of Python, and the CPU it ran on), the
    steps the engine launched ahead of the host (or dropped), the graph and tier events."""
    engine = bench.engine
    events = bench.bus.subscribe(after_seq=None, max_queue=100_000)
    ahead = engine.ahead
    taken_before, dropped_before = ahead.taken, ahead.dropped
    runs, clocks, probes = [], [], []
    try:
        for _ in range(count):
            runs.append(generate_all(bench, prompts, args.new_tokens))
            clocks.append(sm_clock_mhz(engine.device))
            probes.append({"us": host_probe_us(), "cpu": current_cpu()})
        seen = event_counts(events.drain())
    finally:
        events.close()
    record = {
        "visit": visit, "decode_tok_s": [round(r.decode_tok_s, 1) for r in runs], "sm_clock_mhz": clocks,
        "host_probe": probes,
        "steps_taken_ahead": ahead.taken - taken_before, "steps_dropped_ahead": ahead.dropped - dropped_before,
        "events": seen,
    }
    return runs, record


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of MTP off and on per batch size, and the summary. Each visit of a mode (_VISITS) builds its engine,
    warms it up (_warm_up), then times about half of `--repeats` runs (the first visit of each mode the odd one);
    each mode's figure is the median of its `--repeats` runs."""
    context = args.prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS
    # (mode, batch) -> the runs of the mode's first visit, then of its second
    visits: dict[tuple[bool, int], list[list]] = {(mtp, batch): [] for mtp in (False, True) for batch in args.batches}
    records: dict[tuple[bool, int], list[dict[str, Any]]] = {key: [] for key in visits}
    active = {False: False, True: False}
    for visit, mtp in enumerate(_VISITS):
        timed = (args.repeats + 1 - visit // 2) // 2
        if timed == 0:
            continue
        bench = build_engine(args, batch_mtp=mtp, batch=max(args.batches), context=context)
        try:
            active[mtp] = bench.engine.mtp_on
            for batch in args.batches:
                prompts = prompts_for(bench, args.prompt_source, batch, args.prompt_tokens)
                warmup_runs = _warm_up(bench, prompts, args)
                runs, record = _timed_runs(bench, prompts, args, timed, visit)
                visits[(mtp, batch)].append(runs)
                records[(mtp, batch)].append({**record, "warmup_runs": warmup_runs})
        finally:
            bench.close()
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for batch in args.batches:
        off_visits, on_visits = visits[(False, batch)], visits[(True, batch)]
        off_runs, on_runs = sum(off_visits, []), sum(on_visits, [])
        off, on = _row(args, False, active[False], batch, off_runs), _row(args, True, active[True], batch, on_runs)
        off["visits"], on["visits"] = records[(False, batch)], records[(True, batch)]
        rows += [off, on]
        if off["decode_tok_s"] and on["decode_tok_s"]:
            summary[f"speedup_b{batch}"] = on["decode_tok_s"] / off["decode_tok_s"]
            # the run's halves apart (off then on, on then off): how far the ratio moves within one run
            summary[f"speedup_b{batch}_halves"] = [_median_rate(b) / _median_rate(a)
                                                   for a, b in zip(off_visits, on_visits)]
        summary[f"tokens_per_step_b{batch}"] = on["tokens_per_step"]
        summary[f"same_tokens_b{batch}"] = (off_runs[0].token_ids == on_runs[0].token_ids
                                            and off["same_tokens_each_run"] and on["same_tokens_each_run"])
    return rows, summary


def _median_rate(runs: list) -> float:
    return statistics.median(r.decode_tok_s for r in runs)


def run(args: argparse.Namespace) -> int:
    """MTP off and on (engines built off, on, on, off); speedups, tokens per step and the same-tokens check;
    print, write the JSON."""
    device = device_of(args.device)
    rows, summary = measure(args)
    if "speedup_b1" in summary:
        summary["meets_b1_target"] = summary["speedup_b1"] >= TARGET_SPEEDUP_B1
    emit(args, "mtp", rows, summary, device,
         ("mtp", "depth", "batch", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "tokens_per_step",
          "acceptance", "mtp_active", "steps"))
    return 0
