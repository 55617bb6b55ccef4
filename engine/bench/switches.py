"""`strata-engine bench switches`: each opt-in switch off vs on, measured where it claims to help.

Every switch gets the same two figures on a fresh engine per state: `cold_s` (the first request batch, graph
captures and compilation included: where CAPTURE_ALL and COMPILE pay or save) and `decode_tok_s` (a second,
warm run: where FUSED_PROJ, PINNED_STAGING and COMPILE claim to help). SPLIT_ATTN and PAGED_ATTN claim
long-context decode, so they are measured with `--long-prompt-tokens` prompts. A switch that degraded during
its run says so (`degraded`): its "on" figures are then the fallback path's.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.bench.common import device_of, emit, random_prompt, save_partial
from engine.bench.engine_driver import build_engine, generate_all
from engine.switches import get_switch, switch_names

LONG_CONTEXT_SWITCHES = ("SPLIT_ATTN", "PAGED_ATTN")  # their effect is on long spans
_CONTEXT_MARGIN_TOKENS = 64


def chosen(only: str) -> list[str]:
    """Switch names from `--only` (validated against the registry), or all of them."""
    if not only.strip():
        return switch_names()
    return [get_switch(name.strip()).name for name in only.split(",") if name.strip()]


def measure(args: argparse.Namespace, name: str, on: bool) -> list[dict[str, Any]]:
    """Rows for one switch in one state, on a fresh engine."""
    prompt_tokens = args.long_prompt_tokens if name in LONG_CONTEXT_SWITCHES else args.prompt_tokens
    bench = build_engine(args, switches={name: on}, batch=max(args.batches),
                         context=prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS)
    rows = []
    try:
        vocab = bench.engine.lm.config.vocab_size
        for batch in args.batches:
            prompts = [random_prompt(prompt_tokens, vocab, seed=20 * batch + i) for i in range(batch)]
            cold = generate_all(bench, prompts, args.new_tokens)
            warm = generate_all(bench, prompts, args.new_tokens)
            state = bench.engine.board.states[name]
            rows.append({"switch": name, "state": "on" if on else "off", "batch": batch,
                         "prompt_tokens": prompt_tokens, "cold_s": cold.wall_s, "decode_tok_s": warm.decode_tok_s,
                         "degraded": state.degraded, "reason": state.reason or None})
    finally:
        bench.close()
    for row in rows:  # the next state's engine needs this process's memory back; a leak shows here
        row["mib_left_after_close"] = bench.mib_left_after_close
    return rows


def run(args: argparse.Namespace) -> int:
    """Each chosen switch off then on; speedups in the summary; print, write the JSON."""
    device = device_of(args.device)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for name in chosen(args.only):
        off, on = measure(args, name, False), measure(args, name, True)
        rows += off + on
        save_partial(args, "switches", rows, device)
        for a, b in zip(off, on):
            if a["decode_tok_s"] and b["decode_tok_s"]:
                summary[f"{name}_decode_speedup_b{a['batch']}"] = b["decode_tok_s"] / a["decode_tok_s"]
            summary[f"{name}_cold_ratio_b{a['batch']}"] = b["cold_s"] / a["cold_s"] if a["cold_s"] else None
    emit(args, "switches", rows, summary, device,
         ("switch", "state", "batch", "prompt_tokens", "cold_s", "decode_tok_s", "degraded", "reason"))
    return 0
