"""`strata-engine bench ttft`: time to first token for fresh long prompts (nothing cached).

One engine (1 slot, context = the largest size + a margin). A short warm-up request first captures the
small prefill buckets; each measured prompt is new random ids, so the prefix cache cannot help. Graphs
captured during a measured prefill (new length buckets: the first prompt that long) are counted in
`captures`, since their capture time is part of that prompt's TTFT.

Where each prompt's time went, from the timings the engine hands its prefill pacer: `chunk_s` (the prompt's
chunks, device-synchronized), `fill_s` (handing its blocks to the prefix-cache tier) and `other_s` (the rest of
the steps: scheduling, telemetry, tier upkeep). A size given twice (`--prompt-sizes 176K,176K`) is measured twice:
a fresh prompt of the same length after one whose blocks the tier now holds.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.bench.common import device_of, emit, random_prompt, save_partial
from engine.bench.engine_driver import StepLog, build_engine, generate_all

_CONTEXT_MARGIN_TOKENS = 64
_WARMUP_PROMPT_TOKENS = 512


def _graph_count(bench: Any) -> int:
    return len(bench.graph_snapshot().get("graphs", []))


def run(args: argparse.Namespace) -> int:
    """TTFT of each prompt size, smallest first, on one engine; print the table, write the JSON."""
    device = device_of(args.device)
    sizes = sorted(args.prompt_sizes)
    bench = build_engine(args, batch=1, context=sizes[-1] + _CONTEXT_MARGIN_TOKENS)
    rows: list[dict[str, Any]] = []
    try:
        vocab = bench.engine.lm.config.vocab_size
        generate_all(bench, [random_prompt(min(_WARMUP_PROMPT_TOKENS, sizes[0]), vocab, seed=7)], 2)
        for i, size in enumerate(sizes):
            before = _graph_count(bench)
            with StepLog(bench) as log:
                stats = generate_all(bench, [random_prompt(size, vocab, seed=100 + i)], 1)
            ttft_s = stats.ttft_s[0]
            parts = log.summary()
            rows.append({"prompt_tokens": size, "ttft_s": ttft_s, "prefill_tok_s": size / ttft_s,
                         "chunk_s": parts["during_chunk_s"], "fill_s": parts["during_fill_s"],
                         "other_s": ttft_s - parts["during_chunk_s"] - parts["during_fill_s"], "steps": stats.steps,
                         "captures": _graph_count(bench) - before, "graphs_active": bench.graphs_active})
            save_partial(args, "ttft", rows, device)
    finally:
        bench.close()
    summary: dict[str, Any] = {}
    times: dict[int, int] = {}  # a size measured again (`176K,176K`) gets its own key: ttft_s_180224, ttft_s_180224_2
    for r in rows:
        n = times[r["prompt_tokens"]] = times.get(r["prompt_tokens"], 0) + 1
        summary[f"ttft_s_{r['prompt_tokens']}" + (f"_{n}" if n > 1 else "")] = r["ttft_s"]
    emit(args, "ttft", rows, summary, device,
         ("prompt_tokens", "ttft_s", "prefill_tok_s", "chunk_s", "fill_s", "other_s", "steps", "captures",
          "graphs_active"))
    return 0
