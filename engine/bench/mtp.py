"""`strata-engine bench mtp`: MTP speculative drafting on vs off on the same engine options and prompts.

Per batch size: decode tok/s without drafting and with `--batch-mtp --mtp-depth K`, the acceptance rate of
each draft position, and the tokens each slot gains per decode step. Greedy sampling, so both runs emit the
same tokens (`same_tokens` checks it) and the speedup is the drafting's alone. Acceptance only means something
on trained weights: the default model is the built-in strata-tiny; text prompts go through its tokenizer.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.bench.common import device_of, emit, random_prompt
from engine.bench.engine_driver import BenchEngine, build_engine, generate_all

TARGET_SPEEDUP_B1 = 1.5
_CONTEXT_MARGIN_TOKENS = 64
_TEXT = ("The history of the lighthouse begins with fires kept burning on hilltops to guide ships home. "
         "Later, towers of stone carried lanterns, and keepers trimmed the wicks through the night. "
         "In the nineteenth century, lenses made the light visible far out at sea, and each lighthouse "
         "was given its own pattern of flashes so that sailors could tell one coast from another. ")


def prompts_for(bench: BenchEngine, source: str, batch: int, n_tokens: int) -> list[list[int]]:
    """`batch` prompts of exactly `n_tokens`: natural text through the tokenizer, or random ids."""
    vocab = bench.engine.lm.config.vocab_size
    tokenizer = bench.engine.tokenizer
    if source == "random" or tokenizer is None:
        return [random_prompt(n_tokens, vocab, seed=i) for i in range(batch)]
    base = tokenizer.encode(_TEXT)
    prompts = []
    for i in range(batch):
        ids = tokenizer.encode(f"Story {i}. ") + base * (n_tokens // max(1, len(base)) + 1)
        prompts.append(ids[:n_tokens])
    return prompts


def measure(args: argparse.Namespace, mtp: bool) -> tuple[list[dict[str, Any]], dict[int, list[list[int]]]]:
    bench = build_engine(args, batch_mtp=mtp, batch=max(args.batches),
                         context=args.prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS)
    rows, outputs = [], {}
    try:
        for batch in args.batches:
            prompts = prompts_for(bench, args.prompt_source, batch, args.prompt_tokens)
            generate_all(bench, prompts, args.new_tokens)  # capture every bucket first
            stats = generate_all(bench, prompts, args.new_tokens)
            outputs[batch] = stats.token_ids
            acceptance = stats.acceptance_per_position
            rows.append({
                "mtp": "on" if mtp else "off", "depth": args.mtp_depth if mtp else 0, "batch": batch,
                "decode_tok_s": stats.decode_tok_s, "tokens_per_step": stats.tokens_per_step,
                "acceptance": [None if a is None else round(a, 4) for a in acceptance],
                "mtp_active": bench.engine.mtp_on, "steps": stats.steps,
            })
    finally:
        bench.close()
    return rows, outputs


def run(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    off_rows, off_out = measure(args, mtp=False)
    on_rows, on_out = measure(args, mtp=True)
    rows = off_rows + on_rows
    summary: dict[str, Any] = {}
    for batch in args.batches:
        off = next(r for r in off_rows if r["batch"] == batch)
        on = next(r for r in on_rows if r["batch"] == batch)
        if off["decode_tok_s"] and on["decode_tok_s"]:
            summary[f"speedup_b{batch}"] = on["decode_tok_s"] / off["decode_tok_s"]
        summary[f"tokens_per_step_b{batch}"] = on["tokens_per_step"]
        summary[f"same_tokens_b{batch}"] = off_out.get(batch) == on_out.get(batch)
    if "speedup_b1" in summary:
        summary["meets_b1_target"] = summary["speedup_b1"] >= TARGET_SPEEDUP_B1
    emit(args, "mtp", rows, summary, device,
         ("mtp", "depth", "batch", "decode_tok_s", "tokens_per_step", "acceptance", "mtp_active", "steps"))
    return 0
