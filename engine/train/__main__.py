"""`python -m engine.train`: make builtin:strata-tiny (corpus, tokenizer, joint training, export, model card).

Example (the GPU run; see docs/TRAINING.md):
    python -m engine.train --out engine/models/strata-tiny --time-budget-s 420 --deadline-s 540
A quick CPU rehearsal on the standard library alone:
    python -m engine.train --out /tmp/tiny --stdlib-only --tiny --steps 40 --device cpu
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from engine.train import pipeline
from engine.train.loop import TrainSettings
from engine.train.recipe import ArchSettings, count_parameters

# Export, reload and the two final evaluations take well under this on a GPU.
_FINISH_RESERVE_S = 45.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda:N")
    p.add_argument("--root", action="append", dest="roots", help="corpus root (repeatable; default: stdlib + site-packages)")
    p.add_argument("--stdlib-only", action="store_true", help="corpus from the standard library alone (rehearsals)")
    p.add_argument("--max-corpus-mib", type=int, default=pipeline.DataSettings.max_corpus_mib)
    p.add_argument("--heldout-per-mille", type=int, default=pipeline.DataSettings.heldout_per_mille)
    p.add_argument("--tokenizer-sample-mib", type=int, default=48)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tiny", action="store_true", help="a very small model and batch for CPU rehearsals")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: fit --time-budget-s)")
    p.add_argument("--time-budget-s", type=float, default=None, help="seconds of training steps")
    p.add_argument("--deadline-s", type=float, default=None, help="seconds for the whole script; trims the budget")
    p.add_argument("--seq-tokens", type=int, default=TrainSettings.seq_tokens)
    p.add_argument("--batch-seqs", type=int, default=TrainSettings.batch_seqs)
    p.add_argument("--lr", type=float, default=TrainSettings.lr)
    p.add_argument("--warmup-steps", type=int, default=TrainSettings.warmup_steps)
    p.add_argument("--mtp-weight", type=float, default=TrainSettings.mtp_weight)
    p.add_argument("--mtp-distill", type=float, default=TrainSettings.mtp_distill)
    p.add_argument("--eval-every-steps", type=int, default=TrainSettings.eval_every_steps)
    p.add_argument("--seed", type=int, default=TrainSettings.seed)
    return p


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _settings(args: argparse.Namespace, started_s: float) -> TrainSettings:
    budget_s = args.time_budget_s
    if args.deadline_s is not None:
        left_s = args.deadline_s - (time.perf_counter() - started_s) - _FINISH_RESERVE_S
        budget_s = left_s if budget_s is None else min(budget_s, left_s)
        if budget_s <= 0:
            raise SystemExit(f"--deadline-s={args.deadline_s}: no time left for training after data preparation")
    return TrainSettings(
        seq_tokens=args.seq_tokens, batch_seqs=args.batch_seqs, lr=args.lr, warmup_steps=args.warmup_steps,
        mtp_weight=args.mtp_weight, mtp_distill=args.mtp_distill, steps=args.steps, time_budget_s=budget_s,
        eval_every_steps=args.eval_every_steps, seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    started_s = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started_s:7.1f} s] {msg}", flush=True)  # noqa: E731
    _seed_everything(args.seed)
    roots = [sysconfig.get_paths()["stdlib"]] if args.stdlib_only else args.roots
    data_settings = pipeline.DataSettings(roots=roots, max_corpus_mib=args.max_corpus_mib,
                                          heldout_per_mille=args.heldout_per_mille,
                                          vocab_size=args.vocab_size, tokenizer_sample_mib=args.tokenizer_sample_mib)
    arch = ArchSettings(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=32, intermediate_size=128) if args.tiny else ArchSettings()
    if args.tiny:
        data_settings.eval_windows, data_settings.full_eval_max_windows = 8, 32
    data = pipeline.prepare_data(data_settings, log)
    # CUDA is first touched only now: the data preparation above forks worker processes
    device = torch.device(("cuda:0" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    settings = _settings(args, started_s)
    model, result = pipeline.train(data, arch, settings, data_settings.eval_windows, device, log)
    pipeline.write_outputs(args.out, model, data, data_settings, log)
    sample, full = pipeline.measure_exported(args.out, data, settings.seq_tokens, data_settings.full_eval_max_windows, device)
    report = {
        "command": "python -m engine.train " + shlex.join(argv),
        "corpus": data.summary,
        "model": {"parameters": count_parameters(model), "architecture": "Qwen3 + 1 DeepSeek-style MTP layer",
                  "tied_embeddings": True, "max_position_embeddings": model.config.max_position_embeddings,
                  **arch.as_dict()},
        "settings": pipeline.settings_for_card(settings, data_settings),
        "environment": pipeline.environment(device),
    }
    report["train"] = pipeline.train_summary(result, settings, time.perf_counter() - started_s)
    pipeline.finish_card(args.out, report, sample, full, result, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
