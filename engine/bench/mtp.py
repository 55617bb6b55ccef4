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
from pathlib import Path
from typing import Any

from engine.bench.common import device_of, emit, random_prompt
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


# Both engines live at once, so neither may take the free VRAM for its prefix tier (the default on CUDA): the
# bench's prompts need a few blocks.
_TIER_BUDGET_MIB = 256.0


def _row(args: argparse.Namespace, bench: BenchEngine, mtp: bool, batch: int, runs: list) -> dict[str, Any]:
    rates = [r.decode_tok_s for r in runs]
    stats = runs[0]
    acceptance = stats.acceptance_per_position
    return {
        "mtp": "on" if mtp else "off", "depth": args.mtp_depth if mtp else 0, "batch": batch,
        "decode_tok_s": statistics.median(rates), "decode_tok_s_min": min(rates), "decode_tok_s_max": max(rates),
        "tokens_per_step": stats.tokens_per_step,
        "acceptance": [None if a is None else round(a, 4) for a in acceptance],
        "mtp_active": bench.engine.mtp_on, "steps": stats.steps,
        "same_tokens_each_run": all(r.token_ids == stats.token_ids for r in runs),
    }


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of MTP off and on per batch size, and the summary. One engine each, both alive: their timed runs
    alternate (off, on, on, off, ...), so a drift of the machine over the runs weighs on both modes alike; a
    batch-1 step of a tiny model is a fraction of a millisecond and one run moves a lot from the next
    (docs/BENCHMARKS.md, the eleventh and thirteenth sessions). Each mode's figure is the median of `--repeats`."""
    context = args.prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS
    budget = _TIER_BUDGET_MIB if device_of(args.device).type == "cuda" else None
    benches = {}
    try:
        for mtp in (False, True):
            benches[mtp] = build_engine(args, batch_mtp=mtp, batch=max(args.batches), context=context,
                                        tier_budget_mib=budget)
        rows: list[dict[str, Any]] = []
        summary: dict[str, Any] = {}
        for batch in args.batches:
            prompts = prompts_for(benches[False], args.prompt_source, batch, args.prompt_tokens)
            runs: dict[bool, list] = {False: [], True: []}
            for mtp in (False, True):
                generate_all(benches[mtp], prompts, args.new_tokens)  # capture every bucket first
            for i in range(args.repeats):
                for mtp in ((False, True) if i % 2 == 0 else (True, False)):
                    runs[mtp].append(generate_all(benches[mtp], prompts, args.new_tokens))
            off, on = (_row(args, benches[mtp], mtp, batch, runs[mtp]) for mtp in (False, True))
            rows += [off, on]
            if off["decode_tok_s"] and on["decode_tok_s"]:
                summary[f"speedup_b{batch}"] = on["decode_tok_s"] / off["decode_tok_s"]
                # each on run against the off run beside it: the spread of the speed-up itself
                pairs = [b.decode_tok_s / a.decode_tok_s for a, b in zip(runs[False], runs[True])]
                summary[f"speedup_b{batch}_pairs_min"] = min(pairs)
                summary[f"speedup_b{batch}_pairs_max"] = max(pairs)
            summary[f"tokens_per_step_b{batch}"] = on["tokens_per_step"]
            summary[f"same_tokens_b{batch}"] = (runs[False][0].token_ids == runs[True][0].token_ids
                                                and off["same_tokens_each_run"] and on["same_tokens_each_run"])
    finally:
        for bench in benches.values():
            bench.close()
    return rows, summary


def run(args: argparse.Namespace) -> int:
    """MTP off and on, their runs alternating; speedups, tokens per step and the same-tokens check; print, write
    the JSON."""
    device = device_of(args.device)
    rows, summary = measure(args)
    if "speedup_b1" in summary:
        summary["meets_b1_target"] = summary["speedup_b1"] >= TARGET_SPEEDUP_B1
    emit(args, "mtp", rows, summary, device,
         ("mtp", "depth", "batch", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "tokens_per_step",
          "acceptance", "mtp_active", "steps"))
    return 0
