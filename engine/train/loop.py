"""The joint training loop: next-token loss plus a weighted MTP loss, periodic held-out evaluation, best checkpoint.

The schedule is step-based (warm-up, then cosine decay). When only a time budget is given, the loop times its
first steps and fixes the step count from that, so the schedule still ends where the budget does; the log and
the model card record the step count, and `--steps N` repeats the run exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from engine.train.evaluate import EvalFigures, evaluate, positions_for
from engine.train.packing import BatchSampler

_CALIBRATION_STEPS = 30
_CALIBRATION_SKIP = 10  # first steps pay for allocator warm-up and kernel selection


@dataclass
class TrainSettings:
    """Hyper-parameters of one run; every field is recorded in the model card."""

    seq_tokens: int = 1024
    batch_seqs: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 300
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    mtp_weight: float = 0.5
    mtp_distill: float = 0.5  # share of the MTP loss taken against the main model's own t+2 distribution
    steps: int | None = None
    time_budget_s: float | None = None
    eval_every_steps: int = 250
    patience_evals: int = 4
    seed: int = 1234
    bf16: bool = True

    def validate(self) -> None:
        if self.steps is None and self.time_budget_s is None:
            raise ValueError("TrainSettings: give steps or time_budget_s")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps={self.steps}: expected >= 1")
        if not 0.0 <= self.mtp_distill <= 1.0:
            raise ValueError(f"mtp_distill={self.mtp_distill}: expected 0..1")
        for name in ("seq_tokens", "batch_seqs", "eval_every_steps", "patience_evals"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected >= 1")


@dataclass
class TrainResult:
    """What happened: steps run, where the best held-out loss was, timings and the evaluation history."""

    steps_run: int
    planned_steps: int
    best_step: int
    best: EvalFigures
    wall_s: float
    tokens_seen: int
    tokens_per_s: float
    stop_reason: str
    history: list[dict[str, float]] = field(default_factory=list)


def lr_at(step: int, settings: TrainSettings, total_steps: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    span = max(1, total_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    floor = settings.lr * settings.min_lr_ratio
    return floor + (settings.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def joint_loss(model: torch.nn.Module, rows: torch.Tensor, settings: TrainSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, main, mtp) losses for rows of `T + 2` ids."""
    inputs = rows[:, :-2]
    positions = positions_for(inputs)
    hidden = model(inputs, positions, None)  # [B, T, H]; kv=None is the model's plain causal path
    main_logits = model.logits(hidden)  # [B, T, V]
    vocab = main_logits.shape[-1]
    main = F.cross_entropy(main_logits.reshape(-1, vocab).float(), rows[:, 1:-1].reshape(-1))
    mtp_logits = model.draft_logits(model.mtp(hidden, rows[:, 1:-1], positions, None, depth=0))  # [B, T, V] for t+2
    mtp = F.cross_entropy(mtp_logits.reshape(-1, vocab).float(), rows[:, 2:].reshape(-1))
    if settings.mtp_distill > 0:
        # the main model's own distribution for t+2 (from position t+1) is what a draft is checked against
        teacher = main_logits[:, 1:].detach().float().softmax(-1)
        distill = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab).float(), teacher.reshape(-1, vocab))
        mtp = (1 - settings.mtp_distill) * mtp + settings.mtp_distill * distill
    return main + settings.mtp_weight * mtp, main, mtp


def make_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    """AdamW; norms and biases (1-D tensors) get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(settings.beta1, settings.beta2), fused=fused)


class Trainer:
    """Runs `TrainSettings` on a model; `run()` returns the result and leaves the best weights loaded."""

    def __init__(
        self,
        model: torch.nn.Module,
        sampler: BatchSampler,
        eval_rows: torch.Tensor,
        settings: TrainSettings,
        log: Callable[[str], None] = print,
    ) -> None:
        settings.validate()
        self.model = model
        self.sampler = sampler
        self.eval_rows = eval_rows
        self.settings = settings
        self.log = log
        self.device = next(model.parameters()).device
        self.optimizer = make_optimizer(model, settings)
        self.autocast = settings.bf16 and self.device.type == "cuda"

    def _step(self, step: int, total_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.settings, total_steps)
        rows = self.sampler.next_batch()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            total, main, mtp = joint_loss(self.model, rows, self.settings)
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        return main.detach(), mtp.detach()

    def _evaluate(self) -> EvalFigures:
        return evaluate(self.model, self.eval_rows, batch_rows=self.settings.batch_seqs, autocast_bf16=self.autocast)

    def _plan_steps(self, started_s: float, step_times: list[float], done: int) -> int:
        if self.settings.steps is not None:
            return self.settings.steps
        per_step_s = sorted(step_times)[len(step_times) // 2]
        # evaluation passes take time from the same budget; each costs about as much as a few training steps
        per_step_s *= 1.0 + 4.0 / self.settings.eval_every_steps
        left_s = self.settings.time_budget_s - (time.perf_counter() - started_s)
        return done + max(1, int(left_s / per_step_s))

    def _checkpoint(self, step: int, train_loss: float, started_s: float, total_steps: int) -> bool:
        """Evaluate, keep the weights if they are the best so far; True when patience has run out."""
        figures = self._evaluate()
        elapsed_s = time.perf_counter() - started_s
        tokens = step * self.settings.batch_seqs * self.settings.seq_tokens
        self.history.append({"step": step, "elapsed_s": elapsed_s, "train_loss": train_loss, **figures.as_dict()})
        self.log(
            f"step {step}/{total_steps} train {train_loss:.4f} | held-out loss {figures.loss:.4f} "
            f"acc {figures.next_token_accuracy:.4f} agree {figures.mtp_agreement:.4f} | "
            f"{tokens / elapsed_s:,.0f} tok/s, {elapsed_s:.0f} s"
        )
        if self.best is None or figures.loss < self.best.loss:
            self.best, self.best_step, self.bad_evals = figures, step, 0
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            return False
        self.bad_evals += 1
        return self.bad_evals >= self.settings.patience_evals

    def _calibrate(self, step: int, t0: float, started_s: float, step_times: list[float], total_steps: int) -> int:
        """Time the first steps; at the last calibration step, fix the step count from their median."""
        if self.settings.steps is not None or step > _CALIBRATION_STEPS:
            return total_steps
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if step > _CALIBRATION_SKIP:
            step_times.append(time.perf_counter() - t0)
        if step < _CALIBRATION_STEPS:
            return total_steps
        planned = self._plan_steps(started_s, step_times, step)
        median_s = sorted(step_times)[len(step_times) // 2]
        step_tokens = self.settings.batch_seqs * self.settings.seq_tokens
        self.log(f"calibrated: {median_s * 1000:.1f} ms/step ({step_tokens / median_s:,.0f} tok/s in steps alone); "
                 f"{planned} steps fit the {self.settings.time_budget_s:.0f} s budget")
        return planned

    def run(self) -> TrainResult:
        s = self.settings
        torch.manual_seed(s.seed)
        self.model.train()
        started_s = time.perf_counter()
        total_steps = s.steps if s.steps is not None else 10**9
        self.best, self.best_state, self.best_step, self.bad_evals = None, None, 0, 0
        self.history: list[dict[str, float]] = []
        step, stop_reason, step_times = 0, "steps done", []
        while step < total_steps:
            t0 = time.perf_counter()
            main, _ = self._step(step, total_steps)
            step += 1
            total_steps = self._calibrate(step, t0, started_s, step_times, total_steps)
            over_budget = s.time_budget_s is not None and time.perf_counter() - started_s > s.time_budget_s * 1.05
            if step % s.eval_every_steps == 0 or step == total_steps or over_budget:
                if self._checkpoint(step, main.item(), started_s, total_steps):
                    stop_reason = f"held-out loss did not improve for {self.bad_evals} evaluations"
                    break
            if over_budget:
                stop_reason = "time budget spent"
                break
        if total_steps == 10**9:  # stopped before calibration finished
            total_steps = step
        self.model.load_state_dict(self.best_state)
        wall_s = time.perf_counter() - started_s
        tokens_seen = step * s.batch_seqs * s.seq_tokens
        return TrainResult(
            steps_run=step,
            planned_steps=total_steps,
            best_step=self.best_step,
            best=self.best,
            wall_s=wall_s,
            tokens_seen=tokens_seen,
            tokens_per_s=tokens_seen / wall_s,
            stop_reason=stop_reason,
            history=self.history,
        )


def settings_dict(settings: TrainSettings) -> dict[str, object]:
    """The settings as plain values for JSON and the model card."""
    return asdict(settings)
