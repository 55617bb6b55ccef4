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


def measure(args: argparse.Namespace, mtp: bool) -> tuple[list[dict[str, Any]], dict[int, list[list[int]]]]:
    """Rows (and the generated tokens per batch size) for MTP drafting off or on."""
    bench = build_engine(args, batch_mtp=mtp, batch=max(args.batches),
                         context=args.prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS)
    rows, outputs = [], {}
    try:
        for batch in args.batches:
            prompts = prompts_for(bench, args.prompt_source, batch, args.prompt_tokens)
            generate_all(bench, prompts, args.new_tokens)  # capture every bucket first
            # A batch-1 step of a tiny model is a fraction of a millisecond, so one timed run moves a lot from one
            # run to the next (docs/BENCHMARKS.md, the eleventh session): the figure is the median of repeats.
            runs = [generate_all(bench, prompts, args.new_tokens) for _ in range(args.repeats)]
            rates = [r.decode_tok_s for r in runs]
            stats = runs[0]
            outputs[batch] = stats.token_ids
            acceptance = stats.acceptance_per_position
            rows.append({
                "mtp": "on" if mtp else "off", "depth": args.mtp_depth if mtp else 0, "batch": batch,
                "decode_tok_s": statistics.median(rates), "decode_tok_s_min": min(rates),
                "decode_tok_s_max": max(rates), "tokens_per_step": stats.tokens_per_step,
                "acceptance": [None if a is None else round(a, 4) for a in acceptance],
                "mtp_active": bench.engine.mtp_on, "steps": stats.steps,
                "same_tokens_each_run": all(r.token_ids == stats.token_ids for r in runs),
            })
    finally:
        bench.close()
    return rows, outputs


def run(args: argparse.Namespace) -> int:
    """MTP off, then on; speedups, tokens per step and the same-tokens check; print, write the JSON."""
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
        summary[f"same_tokens_b{batch}"] = (off_out.get(batch) == on_out.get(batch) and off["same_tokens_each_run"]
                                            and on["same_tokens_each_run"])
    if "speedup_b1" in summary:
        summary["meets_b1_target"] = summary["speedup_b1"] >= TARGET_SPEEDUP_B1
    emit(args, "mtp", rows, summary, device,
         ("mtp", "depth", "batch", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "tokens_per_step",
          "acceptance", "mtp_active", "steps"))
    return 0
