"""`strata-engine quantize --model M --format fp8|int4 --out DIR`: round a 16/32-bit checkpoint to nearest once
and write it as a compressed-tensors checkpoint, so later starts load the quantized weights directly (the same
weights `--quantize` makes at every start)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import QUANTIZE_FORMATS
from engine.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH", help="checkpoint directory, builtin:NAME or random:SIZE")
    parser.add_argument("--format", required=True, choices=QUANTIZE_FORMATS,
                        help="fp8: e4m3, a scale per output channel (compressed-tensors); fp8-block: a scale per "
                        "128x128 block (Qwen's FP8 layout); int4: a scale and zero point per group of 128")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (must not hold a checkpoint)")
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help="where to quantize: auto | cpu | cuda:N (default auto)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if (out / "config.json").exists():
        raise ConfigError("out", str(out), "already holds a checkpoint (config.json): choose an empty directory")
    if out.exists() and not out.is_dir():
        raise ConfigError("out", str(out), "is a file, not a directory")
    from engine.model.loader import load_checkpoint
    from engine.model.quant.linear import model_bytes
    from engine.model.quant.writer import save_quantized
    from engine.model.random_source import RANDOM_PREFIX, load_random

    load = load_random if args.model.startswith(RANDOM_PREFIX) else load_checkpoint  # random: drawn at load
    lm = load(args.model, dtype="bfloat16", device=args.device, quantize=args.format)
    save_quantized(lm.model, lm.path, out, lm.eos_token_ids)
    print(f"wrote {out}: {lm.weight_format}, {model_bytes(lm.model) / 2**20:.1f} MiB of weights")
    return 0
