"""The recipe end to end: corpus -> tokenizer -> token streams -> training -> export -> measured model card."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from engine.model.loader import load_checkpoint
from engine.train.card import CARD_FILE, render_card
from engine.train.corpus import Corpus, collect
from engine.train.evaluate import EvalFigures, evaluate
from engine.train.export import directory_mib, write_checkpoint
from engine.train.loop import TrainResult, Trainer, TrainSettings, settings_dict
from engine.train.packing import BatchSampler, eval_windows, pack_documents_parallel
from engine.train.recipe import ArchSettings, build_model, count_parameters
from engine.train.sample import SAMPLE_FILE, SAMPLE_SEQ_TOKENS, choose_sample, sample_text, sample_windows
from engine.train.tokenizer_train import eot_id, train_tokenizer

Log = Callable[[str], None]


@dataclass
class DataSettings:
    """Where the corpus comes from and how it is cut."""

    roots: list[str] | None = None
    max_corpus_mib: int = 1000
    heldout_per_mille: int = 25
    vocab_size: int = 8192
    tokenizer_sample_mib: int = 48
    eval_windows: int = 128  # periodic held-out evaluation during training
    full_eval_max_windows: int | None = None  # None: every window of the held-out set
    sample_kib: int = 32  # ~9K tokens: the CPU test scores it in seconds


@dataclass
class Data:
    corpus: Corpus
    tokenizer: Tokenizer
    train_stream: np.ndarray
    heldout_stream: np.ndarray
    summary: dict[str, object]


def prepare_data(settings: DataSettings, log: Log) -> Data:
    """Collect, train the tokenizer on the train side, and pack both sides into token streams."""
    t0 = time.perf_counter()
    corpus = collect(settings.roots, settings.max_corpus_mib * 1024 * 1024, heldout_per_mille=settings.heldout_per_mille)
    log(f"corpus: {json.dumps(corpus.summary())} ({time.perf_counter() - t0:.1f} s)")
    if not corpus.train or not corpus.heldout:
        raise ValueError(
            f"corpus roots {corpus.roots}: {len(corpus.train)} train and {len(corpus.heldout)} held-out files; "
            "both sides need files (add roots or raise heldout_per_mille)"
        )
    t1 = time.perf_counter()
    tokenizer = train_tokenizer((f.text for f in corpus.train), settings.vocab_size, settings.tokenizer_sample_mib * 1024 * 1024)
    log(f"tokenizer: {tokenizer.get_vocab_size()} entries ({time.perf_counter() - t1:.1f} s)")
    t2 = time.perf_counter()

    eos = eot_id(tokenizer)
    train_stream = pack_documents_parallel([f.text for f in corpus.train], tokenizer, eos)
    heldout_stream = pack_documents_parallel([f.text for f in corpus.heldout], tokenizer, eos)
    summary = dict(corpus.summary())
    summary.update(
        train_tokens=int(train_stream.size),
        heldout_tokens=int(heldout_stream.size),
        bytes_per_token=round(summary["train_bytes"] / max(1, train_stream.size), 3),
        tokenizer_vocab=tokenizer.get_vocab_size(),
        tokenizer_trained_on_mib=settings.tokenizer_sample_mib,
        heldout_share=f"{settings.heldout_per_mille / 10:.1f}% of files (by content hash)",
    )
    log(f"packed: {train_stream.size:,} train and {heldout_stream.size:,} held-out tokens ({time.perf_counter() - t2:.1f} s)")
    return Data(corpus, tokenizer, train_stream, heldout_stream, summary)


def train(data: Data, arch: ArchSettings, settings: TrainSettings, eval_windows_n: int, device: torch.device, log: Log):
    """Build the model and run the loop; returns (model with the best weights, TrainResult)."""
    vocab = data.tokenizer.get_vocab_size()
    model = build_model(arch, vocab, settings.seed, device)
    log(f"model: {count_parameters(model):,} parameters, {arch.as_dict()}")
    sampler = BatchSampler(data.train_stream, settings.seq_tokens, settings.batch_seqs, settings.seed, device)
    rows = eval_windows(data.heldout_stream, settings.seq_tokens, max_windows=eval_windows_n)
    result = Trainer(model, sampler, rows, settings, log).run()
    log(f"trained: {result.steps_run} steps, best at {result.best_step}, {result.stop_reason}, "
        f"{result.wall_s:.0f} s, {result.tokens_per_s:,.0f} tok/s")
    return model, result


@torch.no_grad()
def measure_exported(out_dir: Path, data: Data, seq_tokens: int, max_windows: int | None, device: torch.device):
    """Figures of the exported checkpoint as the loader serves it (fp32): (sample, full held-out)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here: the CPU test has no TF32
    lm = load_checkpoint(out_dir, dtype="float32", device=device)
    text = (out_dir / SAMPLE_FILE).read_text()
    sample_rows = sample_windows(text, lm.tokenizer.encode, eot_id(data.tokenizer), SAMPLE_SEQ_TOKENS)
    sample = evaluate(lm.model, sample_rows, batch_rows=16)
    full_rows = eval_windows(data.heldout_stream, seq_tokens, max_windows=max_windows)
    full = evaluate(lm.model, full_rows, batch_rows=32)
    return sample, full


def environment(device: torch.device) -> dict[str, object]:
    """The machine the run used, for the card."""
    env: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def write_outputs(
    out_dir: Path, model, data: Data, data_settings: DataSettings, log: Log
) -> None:
    """The checkpoint and the held-out sample (the card comes after measuring)."""
    write_checkpoint(model, data.tokenizer, out_dir)
    sample_docs = choose_sample([f.text for f in data.corpus.heldout], data_settings.sample_kib * 1024)
    (out_dir / SAMPLE_FILE).write_text(sample_text(sample_docs))
    log(f"exported to {out_dir}: {directory_mib(out_dir):.1f} MiB, sample of {len(sample_docs)} files")


def finish_card(
    out_dir: Path, report: dict, sample: EvalFigures, full: EvalFigures, result: TrainResult, log: Log
) -> None:
    """Fill the measured figures in and write MODEL_CARD.md."""
    report["sample_figures"] = sample.as_dict()
    report["full_figures"] = full.as_dict()
    report["history"] = result.history
    (out_dir / CARD_FILE).write_text(render_card(report))
    log(f"sample: {json.dumps(sample.as_dict())}")
    log(f"full held-out: {json.dumps(full.as_dict())}")
    log(f"wrote {out_dir / CARD_FILE}; directory {directory_mib(out_dir):.1f} MiB")


def train_summary(result: TrainResult, settings: TrainSettings, total_wall_s: float) -> dict[str, object]:
    return {
        "steps_run": result.steps_run,
        "planned_steps": result.planned_steps,
        "best_step (kept)": result.best_step,
        "stop_reason": result.stop_reason,
        "tokens_per_step": settings.batch_seqs * settings.seq_tokens,
        "tokens_seen": result.tokens_seen,
        "training_wall_s": round(result.wall_s, 1),
        "training_tokens_per_s": round(result.tokens_per_s),
        "script_wall_s (corpus to card)": round(total_wall_s, 1),
        "best_heldout_loss_during_training": round(result.best.loss, 4),
        "full_heldout_window_tokens": settings.seq_tokens,
        "sample_window_tokens": SAMPLE_SEQ_TOKENS,
    }


def settings_for_card(settings: TrainSettings, data_settings: DataSettings) -> dict[str, object]:
    merged = dict(settings_dict(settings))
    merged.update({f"data.{k}": v for k, v in vars(data_settings).items() if k != "roots"})
    return merged
