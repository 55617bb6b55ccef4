"""`strata-engine generate`: one prompt through the serving engine; print the text, then one stats line.

It runs the same Engine as `serve` (slots, chunked prefill, KV dtype, MTP drafting, graphs), so the options
that change generation (`--batch-mtp`, `--mtp-depth`, `--kv`, `--context`, switches) can be compared from
the command line: greedy output with and without `--batch-mtp` is token-for-token identical.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import MAX_CONTEXT_TOKENS, add_engine_options, config_from_args
from engine.option_checks import finite_float, whole_number
from engine.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared model options plus --prompt, --max-tokens, --temperature, --top-p, --seed."""
    add_engine_options(parser)
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-tokens", type=whole_number, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--seed", type=whole_number, default=None, help="sampling seed (default: random)")


def _validate(args: argparse.Namespace) -> None:
    if not 0 < args.max_tokens <= MAX_CONTEXT_TOKENS:
        raise ConfigError("max_tokens", args.max_tokens, f"expected 1..{MAX_CONTEXT_TOKENS}")
    if args.seed is not None and not -(1 << 63) <= args.seed < 1 << 64:
        raise ConfigError("seed", args.seed, "expected -2^63..2^64-1 (the range of torch's generators)")
    if args.temperature < 0:
        raise ConfigError("temperature", args.temperature, "expected >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError("top_p", args.top_p, "expected 0 < top_p <= 1")
    if not args.prompt:
        raise ConfigError("prompt", args.prompt, "an empty prompt has nothing to continue")


def _stats_line(stats: dict, device: str) -> str:
    def rate(value: float | None) -> str:
        return f"{value:.1f}" if value else "n/a"

    line = (f"[{stats['completion_tokens']} tokens ({stats['finish_reason']}), prompt {stats['prompt_tokens']} "
            f"tokens at {rate(stats['prefill_tok_s'])} tokens/s, decode {rate(stats['decode_tok_s'])} tokens/s")
    if stats.get("acceptance") is not None:
        per_pos = ", ".join(f"{a:.2f}" for a in stats.get("acceptance_per_position", []) if a is not None)
        line += f", MTP acceptance {stats['acceptance']:.2f} (per position {per_pos})"
    return line + f" on {device}]"


def run(args: argparse.Namespace) -> int:
    """Generate and print. StrataErrors propagate to engine.cli (one line, exit 2)."""
    _validate(args)
    config = config_from_args(args)
    # a one-prompt run needs one slot; the other options keep their meaning
    from dataclasses import replace

    from engine.api import SamplingParams
    from engine.orchestration.generate import generate_text

    config = replace(config, batch=1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    text, stats = generate_text(config, args.prompt, params)
    print(text)
    print(_stats_line(stats, stats.get("device", config.device)))
    sys.stdout.flush()
    return 0
