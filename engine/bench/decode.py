"""`strata-engine bench decode`: decode tok/s of the real Engine per batch size, CUDA graphs on and off.

One engine per graph mode, with `max(batches)` slots; each batch size runs its prompts twice: the first run
captures every graph bucket the timed run will need (length buckets grow with the sequence), the second is
timed. `decode_tok_s` counts tokens after every request has its first one, over that span; `tok_s` is the
end-to-end figure (batch x new tokens / wall time, the prompt's prefill included).
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.bench.common import device_of, emit, random_prompt, save_partial
from engine.bench.engine_driver import build_engine, generate_all
from engine.config import QUANTIZE_MODES
from engine.errors import ConfigError
from engine.model.quant.linear import model_bytes

TARGET_B1_TOK_S = 1500.0
# a --weight-formats item is a --quantize value with options after a "+" each: the decode kernel or the head
FORMAT_OPTIONS = {"tinygemm": {"int4_decode": "tinygemm"}, "head": {"quantize_head": True}}
_CONTEXT_MARGIN_TOKENS = 64


def graph_modes(text: str) -> list[bool]:
    """`on,off` -> [True, False]; anything else is a ConfigError naming the flag."""
    modes = []
    for item in text.split(","):
        if item.strip() not in ("on", "off"):
            raise ConfigError("graph_modes", text, "expected a comma-separated list of on / off")
        modes.append(item.strip() == "on")
    return modes


def weight_formats(text: str) -> list[str]:
    """`off,fp8,fp8+head,int4,int4+tinygemm` -> one engine per item, in that order (off: the checkpoint as stored;
    +head: with `--quantize-head`; +tinygemm: with `--int4-decode tinygemm`)."""
    formats = [item.strip() for item in text.split(",")]
    for fmt in formats:
        base, *options = fmt.split("+")
        if base not in QUANTIZE_MODES or len(set(options)) < len(options) or not set(options) <= FORMAT_OPTIONS.keys():
            raise ConfigError("weight_formats", text, f"expected a comma-separated list of {', '.join(QUANTIZE_MODES)}"
                                                      f", each with +{' / +'.join(FORMAT_OPTIONS)} at most once")
    return formats


def format_overrides(fmt: str) -> dict[str, Any]:
    """The engine options of a --weight-formats item."""
    base, *options = fmt.split("+")
    overrides: dict[str, Any] = {"quantize": base}
    for option in options:
        overrides.update(FORMAT_OPTIONS[option])
    return overrides


def measure(args: argparse.Namespace, graphs: bool, batches: list[int], prompt_tokens: int, new_tokens: int,
            **overrides: Any) -> list[dict[str, Any]]:
    """Rows of decode figures for each batch size on one engine (built with `overrides`)."""
    bench = build_engine(args, graphs=graphs, batch=max(batches),
                         context=prompt_tokens + new_tokens + _CONTEXT_MARGIN_TOKENS, **overrides)
    rows = []
    try:
        lm = bench.engine.lm
        vocab = lm.config.vocab_size
        for batch in batches:
            # Different prompts of the same length: the same graph buckets, but no prefix-cache hit for the timed run
            warmup = [random_prompt(prompt_tokens, vocab, seed=1000 * batch + 500 + i) for i in range(batch)]
            prompts = [random_prompt(prompt_tokens, vocab, seed=1000 * batch + i) for i in range(batch)]
            generate_all(bench, warmup, new_tokens)  # captures every bucket the timed run needs
            stats = generate_all(bench, prompts, new_tokens)
            rows.append({
                "weights": lm.weight_format, "quantize": overrides.get("quantize", "off"),
                "weights_mib": round(model_bytes(lm.model) / 2**20, 3),
                "graphs": "on" if graphs else "off", "graphs_active": bench.graphs_active, "batch": batch,
                "decode_tok_s": stats.decode_tok_s,
                "per_slot_tok_s": stats.decode_tok_s / batch if stats.decode_tok_s else None,
                "tok_s": stats.tokens / stats.wall_s, "ttft_ms": max(stats.ttft_s) * 1e3,
                "steps": stats.steps, "tokens": stats.tokens, "wiring": bench.executor_wiring,
            })
    finally:
        bench.close()
    return rows


def run(args: argparse.Namespace) -> int:
    """Every graph mode x batch size; print the table, write the JSON."""
    device = device_of(args.device)
    rows: list[dict[str, Any]] = []
    for fmt in weight_formats(args.weight_formats or args.quantize):
        for graphs in graph_modes(args.graph_modes):
            measured = measure(args, graphs, args.batches, args.prompt_tokens, args.new_tokens, **format_overrides(fmt))
            rows += [{**row, "quantize": fmt} for row in measured]  # by its item: fp8 and fp8+head, a ratio each
            save_partial(args, "decode", rows, device)
    emit(args, "decode", rows, summarize(rows), device,
         ("weights", "weights_mib", "graphs", "graphs_active", "batch", "decode_tok_s", "per_slot_tok_s", "tok_s",
          "ttft_ms", "steps"))
    return 0


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best batch-1 decode rate against its target, and the graphs speedup per batch."""
    def rate(graphs: str, batch: int) -> float | None:
        return next((r["decode_tok_s"] for r in rows if r["graphs"] == graphs and r["batch"] == batch
                     and r["weights"] == rows[0]["weights"]), None)

    summary: dict[str, Any] = {}
    best_b1 = max((r["decode_tok_s"] or 0.0 for r in rows if r["batch"] == 1), default=0.0)
    if best_b1:
        summary["b1_decode_tok_s"] = best_b1
        summary["meets_b1_target"] = best_b1 >= TARGET_B1_TOK_S
    for batch in sorted({r["batch"] for r in rows}):
        on, off = rate("on", batch), rate("off", batch)
        if on and off:
            summary[f"graphs_speedup_b{batch}"] = on / off
    # --weight-formats: each format's best decode rate against the first format's, per batch
    def best(weights: str, batch: int) -> float:
        return max((r["decode_tok_s"] or 0.0 for r in rows if r["weights"] == weights and r["batch"] == batch),
                   default=0.0)

    formats = list(dict.fromkeys(r["weights"] for r in rows))
    names = {r["weights"]: r.get("quantize", "off") if r.get("quantize", "off") != "off" else r["weights"].split()[0]
             for r in rows}  # fp8 and fp8-block share the word "fp8"
    for weights in formats[1:]:
        for batch in sorted({r["batch"] for r in rows}):
            if best(formats[0], batch) and best(weights, batch):
                summary[f"{names[weights]}_vs_{names[formats[0]]}_b{batch}"] = (
                    best(weights, batch) / best(formats[0], batch))
    return summary
