"""engine.exec.mtp_accept's greedy acceptance as one Triton kernel: a program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.exec.sampler import NO_TOKEN


@triton.jit
def _greedy_accept_kernel(tok_ptr, draft_ptr, slot_ptr, drow_ptr, pend_ptr, pos_ptr, finite_ptr,
                          acc_ptr, emit_ptr, next_ptr, chain_ptr,
                          stride_tok, stride_draft, stride_slot, stride_drow, stride_pend, stride_pos,
                          context_tokens, NO_TOKEN: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    tok = tl.load(tok_ptr + b * stride_tok + j, mask=j < K + 1, other=0)
    draft = tl.load(draft_ptr + b * stride_draft + j, mask=j < K, other=0)
    pos = tl.load(pos_ptr + b * stride_pos + j, mask=j < K + 1, other=0)
    miss = (tok != draft) | (j >= K)
    accepted = tl.min(tl.where(miss, j, BLOCK), axis=0)  # the first draft that differs (K: none did)
    first = tl.sum(tl.where(j == 0, pos, 0), axis=0)
    real = first < context_tokens  # a padding row sits at the context's scratch columns and stays there
    pending = tl.where(real, tl.sum(tl.where(j == accepted, tok, 0), axis=0), tl.load(pend_ptr + b * stride_pend))
    moved = tl.where(real, accepted + 1, 0)
    tl.store(acc_ptr + b, accepted.to(tl.int64))
    emitted = emit_ptr + b * (K + 2)
    tl.store(emitted, accepted.to(tl.int64))
    finite = tl.load(finite_ptr + b) != 0  # the row's logits held no NaN or inf
    tl.store(emitted + 1 + j, tl.where(finite, tok, NO_TOKEN), mask=j < K + 1)
    nxt = next_ptr + b * (K + 4)
    tl.store(nxt, tl.load(slot_ptr + b * stride_slot))
    tl.store(nxt + 1, tl.load(drow_ptr + b * stride_drow))
    tl.store(nxt + 2, pending)
    tl.store(nxt + 3 + j, pos + moved, mask=j < K + 1)
    tl.store(chain_ptr + b * K + j, first + accepted + 1 + j, mask=j < K)


def greedy_accept(tokens: torch.Tensor, drafts: torch.Tensor, slots: torch.Tensor, draft_rows: torch.Tensor,
                  pending: torch.Tensor, positions: torch.Tensor, context_tokens: int, finite: torch.Tensor):
    """(accepted [Bb], emitted [Bb, K+2], next_inputs [Bb, K+4], chain_positions [Bb, K]), long; the inputs may be
    views of the fused step's packed inputs (a contiguous last dim); `finite` [Bb] bool, contiguous."""
    bb, k = drafts.shape
    assert tokens.stride(1) == 1 and drafts.stride(1) == 1 and positions.stride(1) == 1, "contiguous columns"
    assert finite.dtype == torch.bool and finite.is_contiguous(), "finite: one bool per row"
    like = {"dtype": torch.long, "device": tokens.device}
    accepted = torch.empty(bb, **like)
    emitted = torch.empty(bb, k + 2, **like)
    next_inputs = torch.empty(bb, k + 4, **like)
    chain = torch.empty(bb, k, **like)
    _greedy_accept_kernel[(bb,)](
        tokens, drafts, slots, draft_rows, pending, positions, finite, accepted, emitted, next_inputs, chain,
        tokens.stride(0), drafts.stride(0), slots.stride(0), draft_rows.stride(0), pending.stride(0),
        positions.stride(0), context_tokens, NO_TOKEN=NO_TOKEN, K=k, BLOCK=triton.next_power_of_2(k + 1), num_warps=1,
    )
    return accepted, emitted, next_inputs, chain
