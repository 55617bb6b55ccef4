"""Held-out figures for a CausalLM with an MTP head: loss, next-token accuracy and MTP agreement.

MTP agreement is the acceptance a user sees: at position t the MTP head gets the main hidden state h_t and
the true token t+1 and drafts t+2; the draft counts when it equals the main model's own greedy choice for
t+2 given the true t+1 (argmax of the main logits at t+1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F



@dataclass
class EvalFigures:
    """Means over all scored positions of the windows evaluated."""

    loss: float  # main next-token cross-entropy, nats
    mtp_loss: float  # MTP cross-entropy against the true t+2, nats
    next_token_accuracy: float
    mtp_accuracy: float  # MTP draft equals the true t+2
    mtp_agreement: float  # MTP draft equals the main model's greedy t+2
    tokens: int  # positions scored for next-token figures

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def positions_for(ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions 0..T-1 for a batch of windows that each start a fresh context."""
    batch, seq = ids.shape
    return torch.arange(seq, device=ids.device).unsqueeze(0).expand(batch, seq)


def forward_heads(model: torch.nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Main and MTP logits for rows of `T + 2` ids: ([B, T, V] predicting t+1, [B, T, V] predicting t+2).

    Each row is one fresh context with plain causal attention (the model's `kv=None` path), so a window is
    scored exactly as a prompt of those tokens would be.
    """
    inputs = rows[:, :-2]
    positions = positions_for(inputs)
    hidden = model(inputs, positions, None)  # [B, T, H], after the final norm
    main_logits = model.logits(hidden)
    h_mtp = model.mtp(hidden, rows[:, 1:-1], positions, None, depth=0)  # h_t with the true t+1
    return main_logits, model.draft_logits(h_mtp, 0)


class _Totals:
    def __init__(self) -> None:
        self.loss = self.mtp_loss = 0.0
        self.correct = self.mtp_correct = self.agree = 0
        self.tokens = self.pairs = 0

    def add(self, rows: torch.Tensor, main_logits: torch.Tensor, mtp_logits: torch.Tensor) -> None:
        main_logits, mtp_logits = main_logits.float(), mtp_logits.float()
        next_targets, mtp_targets = rows[:, 1:-1], rows[:, 2:]
        vocab = main_logits.shape[-1]
        self.loss += F.cross_entropy(main_logits.reshape(-1, vocab), next_targets.reshape(-1), reduction="sum").item()
        self.mtp_loss += F.cross_entropy(mtp_logits.reshape(-1, vocab), mtp_targets.reshape(-1), reduction="sum").item()
        main_greedy = main_logits.argmax(-1)  # [B, T]: greedy choice for t+1 at each t
        draft = mtp_logits.argmax(-1)  # [B, T]: draft for t+2 at each t
        self.correct += (main_greedy == next_targets).sum().item()
        self.mtp_correct += (draft == mtp_targets).sum().item()
        # draft at t is checked against the main model's greedy token at t+1, which only exists for t < T-1
        self.agree += (draft[:, :-1] == main_greedy[:, 1:]).sum().item()
        self.tokens += next_targets.numel()
        self.pairs += draft[:, :-1].numel()

    def figures(self) -> EvalFigures:
        return EvalFigures(
            loss=self.loss / self.tokens,
            mtp_loss=self.mtp_loss / self.tokens,
            next_token_accuracy=self.correct / self.tokens,
            mtp_accuracy=self.mtp_correct / self.tokens,
            mtp_agreement=self.agree / self.pairs,
            tokens=self.tokens,
        )


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_rows: int = 16, autocast_bf16: bool = False) -> EvalFigures:
    """Figures over `windows` ([N, T + 2] ids), `batch_rows` rows per forward, on the model's device."""
    if windows.dim() != 2 or windows.shape[1] < 4:
        raise ValueError(f"windows: expected [N, T + 2] ids with T >= 2, got shape {tuple(windows.shape)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    totals = _Totals()
    try:
        for start in range(0, windows.shape[0], batch_rows):
            rows = windows[start : start + batch_rows].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                main_logits, mtp_logits = forward_heads(model, rows)
            totals.add(rows, main_logits, mtp_logits)
    finally:
        model.train(was_training)
    return totals.figures()
