"""`strata-engine bench admission`: the seed report's moment, measured. N slots decode; a fresh long prompt
arrives; how fast do the N slots keep decoding while it is prefilled, relative to before it came?

One engine with N + 1 slots and a context that fits the long prompt. The N short generations start, run
`warmup_steps` steps (graph captures), then `baseline_steps` timed steps give the baseline rate. The long prompt
(new random ids: nothing cached) is then added and the engine steps until its first token; the short slots'
tokens over that time give the rate during admission. `decode_ratio` = during / baseline (target >= 0.5).
`max_step_ms` is the longest single step during admission: the worst stall a decoding user saw.

The short slots grow during the admission (by thousands of tokens for a 176K prompt at 6 slots), and a decode
step at a longer context costs more, so after the long prompt's first token `baseline_steps` more steps give
the rate at the end (`after_tok_s`). `decode_ratio` = the time the same tokens would have taken alone (the mean
of the before and after per-token times) / the time they took; `decode_ratio_vs_before` = during / before, the
figure that charges the context growth to the admission.

The issue's second figure is the long prompt's first token against the same prompt length alone: unless
`--no-alone`, a fresh prompt of that length is first prefilled with nothing decoding (`alone_ttft_s`), on the same
engine, twice (`alone_first_ttft_s` is the first run's; `alone_ttft_s`, the figure, the faster run's), and
`ttft_vs_alone` = `long_ttft_s` / `alone_ttft_s`. Where the admission's time went: `during_chunk_s` (the
chunks, device-synchronized, as the engine times them for the pacer), `during_decode_s`, the chunks' count and
sizes, so a slow admission tells pacing (too little time for prefill) from waste (chunks dearer per token than
the lone prompt's). Where chunks run beside the steps (`--prefill-overlap`, default auto: on CUDA), a chunk's time
is its device time from start to end while the slots decoded (`during_chunk_beside_s`), and it overlaps
`during_decode_s`; `--prefill-overlap off` measures chunks between the steps on the same code.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from engine.bench.common import device_of, emit, event_counts, random_prompt, save_partial
from engine.bench.engine_driver import BenchEngine, EngineDied, StepLog, build_engine

TARGET_RATIO = 0.5
TARGET_TTFT_VS_ALONE = 2.0  # issue 17: the admitted prompt's first token within twice its time alone
_CONTEXT_MARGIN_TOKENS = 64


def _short_tokens(shorts: list[Any]) -> int:
    return sum(r.num_output_tokens for r in shorts)


def _timed_steps(bench: BenchEngine, shorts: list[Any], until: Any, max_steps: int,
                 seqs: list[int] | None = None) -> tuple[float, int, list[float]]:
    """Step until `until(steps)`; returns (seconds, short tokens gained, each step's seconds). `seqs` gets the
    event bus's last seq before each step and once after the last (which events each step published)."""
    tokens0, step_s = _short_tokens(shorts), []
    start = time.perf_counter()
    while not until(len(step_s)):
        if len(step_s) >= max_steps:
            raise EngineDied(f"no progress in {len(step_s)} steps (admission benchmark)")
        if seqs is not None:
            seqs.append(bench.bus.last_seq)
        t0 = time.perf_counter()
        bench.step()
        step_s.append(time.perf_counter() - t0)
    if seqs is not None:
        seqs.append(bench.bus.last_seq)
    return time.perf_counter() - start, _short_tokens(shorts) - tokens0, step_s


def _longest_step(step_s: list[float], timings: list[Any], seqs: list[int], events: list[Any]) -> dict[str, Any]:
    """What the admission's longest step held: its decode part, its chunks, its cache fills (as the engine timed
    them for the pacer) and the graph and tier events it published, so a stall names its cause."""
    if not step_s or len(timings) != len(step_s):
        return {}
    i = max(range(len(step_s)), key=step_s.__getitem__)
    timing = timings[i]
    events = [e for e in events if seqs[i] < e.seq <= seqs[i + 1]]
    return {
        "step": i, "ms": step_s[i] * 1e3, "decode_ms": timing.decode_s * 1e3 if timing.decode_s is not None else None,
        "decode_rows": timing.num_decode_rows, "chunk_tokens": sum(c.num_tokens for c in timing.prefill),
        "chunk_ms": sum(c.seconds for c in timing.prefill) * 1e3, "fill_ms": timing.other_prefill_s * 1e3,
        "beside_chunk": timing.beside_chunk, "landed_tokens": sum(c.num_tokens for c in timing.landed),
        "events": [_named(e) for e in events if e.type in ("graph", "tier", "warning")][:8],
    }


def _event_steps_s(step_s: list[float], seqs: list[int], events: list[Any]) -> float:
    """The time of the steps that published a graph or tier event (a capture, a shrink): the stalls' share of
    the admission, which no pacing moves."""
    marked = {e.seq for e in events if e.type in ("graph", "tier")}
    return sum(s for i, s in enumerate(step_s) if any(seqs[i] < seq <= seqs[i + 1] for seq in marked))


def _named(event: Any) -> str:
    """`graph capture decode b8 L4096`, `tier shrink`, `warning runner.decode`: what an event was, in a few words."""
    parts = (event.type, *(getattr(event, name, "") for name in ("action", "kind", "key", "where")))
    return " ".join(str(p) for p in parts if p)


def _ms(step_s: list[float], how: Any) -> float | None:
    return how(step_s) * 1e3 if step_s else None


def measure_one(bench: BenchEngine, args: argparse.Namespace, long_tokens: int, seed: int) -> dict[str, Any]:
    """One admission: baseline rate of the short slots, then their rate while `long_tokens` are prefilled."""
    vocab = bench.engine.lm.config.vocab_size
    context = bench.config.context
    alone_runs: list[float] = []
    alone_parts: list[dict[str, Any]] = []  # each lone run: its chunks' time, and the graph and tier events it saw
    for run in range(0 if args.no_alone else 2):
        events = bench.bus.subscribe(after_seq=None, max_queue=1_000_000)
        lone = bench.add(random_prompt(long_tokens, vocab, seed=seed + 555 + run), 1)
        with StepLog(bench) as log:
            lone_s, _, _ = _timed_steps(bench, [], lambda n: lone.num_output_tokens > 0, long_tokens + 100)
        alone_runs.append(lone_s)
        parts = log.summary()
        alone_parts.append({"ttft_s": alone_runs[-1], "chunk_s": parts["during_chunk_s"],
                            "chunks": parts["during_chunks"],
                            "steps": len(log.timings), "events": event_counts(events.drain())})
        events.close()
        while bench.engine.has_work:  # the lone prompt's request ends at its first token; let the engine settle
            bench.step()
    # The faster run is the figure: the lone time is the prompt's cost without competition, and the faster of two
    # runs carries the least of what one run may pay once (a kernel variant's first compile).
    alone_s = min(alone_runs) if alone_runs else None
    max_tokens = context - args.short_prompt_tokens
    shorts = [bench.add(random_prompt(args.short_prompt_tokens, vocab, seed=seed + i), max_tokens)
              for i in range(args.slots)]
    try:
        warm_bound = args.slots * args.short_prompt_tokens + args.warmup_steps + 100
        _timed_steps(bench, shorts, lambda n: all(r.num_output_tokens for r in shorts) and n >= args.warmup_steps,
                     warm_bound)
        base_s, base_tokens, base_step_s = _timed_steps(
            bench, shorts, lambda n: n >= args.baseline_steps, args.baseline_steps)
        # Graph and tier events of each phase: a bucket captured, evicted or degraded to eager for want of
        # memory (the tier has taken the GPU) changes the decode rate as much as the pacing does.
        events = bench.bus.subscribe(after_seq=None, max_queue=1_000_000)
        long = bench.add(random_prompt(long_tokens, vocab, seed=seed + 999), 1)
        seqs: list[int] = []
        with StepLog(bench) as log:
            during_s, during_tokens, during_step_s = _timed_steps(
                bench, shorts, lambda n: long.num_output_tokens > 0, long_tokens + 100, seqs)
        during_events = events.drain()
        longest = _longest_step(during_step_s, log.timings, seqs, during_events)
        # The shorts kept growing while the prompt was prefilled (thousands of tokens at 176K), and a decode
        # step costs more at a longer context: the same steps again, now without the long prompt, say what
        # their rate would have been at the end of the admission.
        after_s, after_tokens, after_step_s = _timed_steps(
            bench, shorts, lambda n: n >= args.baseline_steps, args.baseline_steps)
        finished_early = sum(1 for r in shorts if r.is_finished)
        after_events = events.drain()
        events.close()
    finally:
        for r in shorts:
            if not r.is_finished:
                bench.engine.abort(r.request_id)
    baseline = base_tokens / base_s
    after = after_tokens / after_s if after_s > 0 and after_tokens else None
    during = during_tokens / during_s if during_s > 0 else None
    ratio = None
    if during is not None and baseline and after:
        # Per-token decode time grows about linearly with the context over the admission, so without the long
        # prompt the same tokens would have taken the mean of the before and after per-token times.
        shorts_alone_s = during_tokens * (1 / baseline + 1 / after) / 2
        ratio = shorts_alone_s / during_s
    return {
        "slots": args.slots, "long_tokens": long_tokens, "baseline_tok_s": baseline, "after_tok_s": after,
        "during_tok_s": during, "decode_ratio": ratio,
        "decode_ratio_vs_before": during / baseline if during is not None and baseline else None,
        "long_ttft_s": during_s, "alone_ttft_s": alone_s, "alone_first_ttft_s": alone_runs[0] if alone_runs else None,
        "alone_runs": alone_parts,
        "ttft_vs_alone": during_s / alone_s if alone_s else None, **log.summary(),
        "during_steps": len(during_step_s), "max_step_ms": _ms(during_step_s, max), "max_step": longest,
        "during_event_step_s": _event_steps_s(during_step_s, seqs, during_events),
        "baseline_step_ms": base_s / max(1, len(base_step_s)) * 1e3, "baseline_max_step_ms": _ms(base_step_s, max),
        # The median and the longest step of the after phase tell a slower step (longer context, an eager
        # bucket) from a few long ones (a cache fill, a capture) inflating the mean.
        "after_step_ms_p50": _ms(after_step_s, statistics.median), "after_max_step_ms": _ms(after_step_s, max),
        "shorts_finished_early": finished_early,
        "events_during": event_counts(during_events), "events_after": event_counts(after_events),
        "graph_errors": [e.error for e in during_events + after_events if e.type == "graph" and e.error][:3],
        "degraded_graphs": bench.graph_snapshot().get("degraded", []),
    }


def run(args: argparse.Namespace) -> int:
    """Measure each long prompt length on one engine; print the table, write the JSON."""
    device = device_of(args.device)
    longest = max(args.long_tokens)
    bench = build_engine(args, batch=args.slots + 1, context=longest + _CONTEXT_MARGIN_TOKENS)
    rows = []
    try:
        for i, long_tokens in enumerate(args.long_tokens):
            rows.append({**measure_one(bench, args, long_tokens, seed=10_000 * (i + 1)),
                         "graphs_active": bench.graphs_active, "kv": bench.config.kv,
                         "chunks_beside_steps": bench.engine.chunks is not None})
            save_partial(args, "admission", rows, device)
    finally:
        bench.close()
    worst = min((r["decode_ratio"] for r in rows if r["decode_ratio"] is not None), default=None)
    slowest = max((r["ttft_vs_alone"] for r in rows if r["ttft_vs_alone"] is not None), default=None)
    summary: dict[str, Any] = {"worst_decode_ratio": worst, "worst_ttft_vs_alone": slowest}
    if worst is not None:
        summary["meets_target"] = worst >= TARGET_RATIO and (slowest is None or slowest <= TARGET_TTFT_VS_ALONE)
    emit(args, "admission", rows, summary, device,
         ("slots", "long_tokens", "baseline_tok_s", "during_tok_s", "after_tok_s", "decode_ratio",
          "decode_ratio_vs_before", "long_ttft_s", "alone_ttft_s", "ttft_vs_alone", "during_steps", "during_chunks",
          "during_chunk_s", "max_step_ms", "kv", "chunks_beside_steps"))
    return 0
