"""A greedy MTP step's acceptance on the device, and what the step after it takes as its inputs.

Given the verify's argmax `tokens` [Bb, K+1] (over the pending token and the K drafts) and the `drafts` [Bb, K]:

- accepted [Bb]: the drafts a row keeps, those equal to the argmax before the first that is not;
- emitted [Bb, K+2]: accepted, then the tokens (a row emits tokens[:accepted + 1]), for one copy to the host; a
  row whose logits were not finite (`finite` False) has sampler.NO_TOKEN for its tokens there;
- next_inputs [Bb, K+4]: the next fused step's packed inputs (runner.verify_inputs' columns: slot, draft row,
  pending token tokens[accepted], positions moved by accepted + 1; a padding row, at the context's scratch
  columns, as it was), for a step launched before the host reads this one (engine.exec.decode_ahead);
- chain_positions [Bb, K]: where the drafter's chain step j (1..K-1) writes, n + accepted + j at column j - 1.

`greedy_acceptance` is the reference, in PyTorch ops (a dozen small kernels); `greedy_acceptance_kernel` is the
same in one Triton kernel (engine.exec.triton_accept), for the FUSED_OPS path: a batch-1 step on a small model is
bound by its kernel count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.exec.sampler import NO_TOKEN


class GreedyAcceptance(NamedTuple):
    accepted: torch.Tensor
    emitted: torch.Tensor
    next_inputs: torch.Tensor
    chain_positions: torch.Tensor


def greedy_acceptance(tokens: torch.Tensor, drafts: torch.Tensor, slots: torch.Tensor, draft_rows: torch.Tensor,
                      pending: torch.Tensor, positions: torch.Tensor, context_tokens: int,
                      finite: torch.Tensor) -> GreedyAcceptance:
    """The reference: `slots`, `draft_rows` [Bb], `pending` [Bb, 1] and `positions` [Bb, K+1] as the fused step's
    inputs (long), `context_tokens` the slot's columns (a padding row's positions start there), `finite` [Bb] bool:
    the row's logits hold no NaN or inf."""
    bb, k = drafts.shape
    accepted = (tokens[:, :k] == drafts).long().cumprod(dim=-1).sum(dim=-1)  # [Bb]
    picked = accepted.view(bb, 1)
    emitted = torch.cat([picked, torch.where(finite.view(bb, 1), tokens, NO_TOKEN)], dim=1)
    real = positions[:, :1] < context_tokens
    pending_next = torch.where(real, tokens.gather(1, picked), pending)
    positions_next = positions + torch.where(real, picked + 1, 0)
    next_inputs = torch.cat([slots.view(bb, 1), draft_rows.view(bb, 1), pending_next, positions_next], dim=1)
    return GreedyAcceptance(accepted, emitted, next_inputs, chain_positions(positions, accepted, k))


def chain_positions(positions: torch.Tensor, accepted: torch.Tensor, k: int) -> torch.Tensor:
    """[Bb, K]: n + accepted + j at column j - 1, n a row's first position (any step, greedy or sampled)."""
    return positions[:, :1] + accepted.view(-1, 1) + torch.arange(1, k + 1, device=positions.device)


def greedy_acceptance_kernel(tokens: torch.Tensor, drafts: torch.Tensor, slots: torch.Tensor,
                             draft_rows: torch.Tensor, pending: torch.Tensor, positions: torch.Tensor,
                             context_tokens: int, finite: torch.Tensor) -> GreedyAcceptance:
    """The same as `greedy_acceptance`, in one Triton kernel (CUDA, or Triton's interpreter)."""
    from engine.exec.triton_accept import greedy_accept

    return GreedyAcceptance(*greedy_accept(tokens, drafts, slots, draft_rows, pending, positions, context_tokens,
                                           finite))
