"""The router's tail and the expert cache's route bookkeeping, each one launch on CUDA.

    weights, ids = top_k_route(logits, k, norm, prior, positions, drift_tokens)   # [N, E] -> [N, k] each
    slots = slots_and_counts(ids, table, miss_slot, valid, counts, misses)        # [N, k] -> [N, k]

A decode step of a seed-scale MoE runs these once per sparse layer (48 a token): done with torch ops they are
about twenty launches a layer (prior lookup, softmax, top-k, renormalisation, cast; table lookup, masks, miss
sum, count scatter), each a few microseconds even inside a CUDA graph, which is more than the layer's experts
take to read. One Triton program per token (the router) and one per block of routes (the books) do the same
work. Both give torch's results: the softmax is fp32 as torch computes it, the top-k is in descending order
with the lower expert first on a tie, and the counts are whole numbers added atomically (exact in fp32 for any
order). On a CPU, and where Triton is missing, the same torch ops as before serve.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path serves then
    triton = None

_BOOK_BLOCK = 256  # routes per program of the bookkeeping kernel


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton is not None


def top_k_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, prior: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, drift_tokens: int = 1,
                backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] (the gate's output), prior [phases, E] fp32 added at phase (positions // drift_tokens) %
    phases -> (weights [N, k] in logits' dtype, ids [N, k] long): softmax in fp32, top-k, optional
    renormalisation (transformers' Qwen3MoeTopKRouter). `backend` "torch" or "triton" (default: by device)."""
    if (backend or ("triton" if _on_triton(logits) else "torch")) == "torch":
        return _route_torch(logits, top_k, norm_topk_prob, prior, positions, drift_tokens)
    N, E = logits.shape
    weights = torch.empty(N, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(N, top_k, dtype=torch.long, device=logits.device)
    if N:
        has_prior = prior is not None
        _route_kernel[(N,)](
            logits, prior if has_prior else logits, positions if has_prior else logits, weights, ids,
            E, logits.stride(0), drift_tokens, prior.shape[0] if has_prior else 1,
            K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(E),
            HAS_PRIOR=has_prior, NORM=norm_topk_prob, num_warps=4)
    return weights, ids


def _route_torch(logits, top_k, norm_topk_prob, prior, positions, drift_tokens):
    dtype = logits.dtype
    if prior is not None:
        phase = torch.div(positions, drift_tokens, rounding_mode="floor") % prior.shape[0]
        logits = logits.float() + prior[phase]  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def slots_and_counts(ids: torch.Tensor, table: torch.Tensor, miss_slot: int, valid: torch.Tensor | None,
                     counts: torch.Tensor, misses: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """ids [N, k], table [E] (expert -> slot; `miss_slot` when not resident), valid [N] bool or None (every row
    real) -> slots [N, k] (-1 on rows that are not real), adding 1 to counts [E] (fp32) for each real route and
    to misses [1] for each real route to the miss slot."""
    if (backend or ("triton" if _on_triton(ids) else "torch")) == "torch":
        N, k = ids.shape
        slots = table[ids]
        real = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid[:, None].expand(N, k)
        misses += ((slots == miss_slot) & real).sum().to(torch.float32)
        counts.index_add_(0, ids.flatten(), real.flatten().to(torch.float32))
        return slots if valid is None else torch.where(real, slots, -1)
    ids = ids.contiguous()
    slots = torch.empty_like(ids)
    R = ids.numel()
    if R:
        _books_kernel[(triton.cdiv(R, _BOOK_BLOCK),)](
            ids, table, valid if valid is not None else ids, slots, counts, misses, R, ids.shape[1], miss_slot,
            HAS_VALID=valid is not None, BLOCK=_BOOK_BLOCK, num_warps=4)
    return slots


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, prior_ptr, pos_ptr, w_ptr, ids_ptr, E, stride_l, drift, phases,
                      K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, HAS_PRIOR: tl.constexpr,
                      NORM: tl.constexpr):
        n = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        e_ok = e < E
        logit = tl.load(logits_ptr + n * stride_l + e, mask=e_ok, other=float("-inf")).to(tl.float32)
        if HAS_PRIOR:
            phase = (tl.load(pos_ptr + n) // drift) % phases
            logit += tl.load(prior_ptr + phase * E + e, mask=e_ok, other=0.0)
        shifted = logit - tl.max(logit, 0)
        num = tl.where(e_ok, tl.exp(shifted), 0.0)
        prob = num / tl.sum(num, 0)
        left = tl.where(e_ok, prob, -1.0)  # probabilities not taken yet (taken ones and padding: -1)
        j = tl.arange(0, K_PAD)
        top_w = tl.zeros((K_PAD,), dtype=tl.float32)
        top_id = tl.zeros((K_PAD,), dtype=tl.int64)
        for step in tl.static_range(K):
            best = tl.max(left, 0)
            pick = tl.min(tl.where(left == best, e, E_PAD), 0)  # the lowest expert on a tie
            top_w = tl.where(j == step, best, top_w)
            top_id = tl.where(j == step, pick.to(tl.int64), top_id)
            left = tl.where(e == pick, -1.0, left)
        if NORM:
            top_w = top_w / tl.sum(tl.where(j < K, top_w, 0.0), 0)
        tl.store(w_ptr + n * K + j, top_w.to(w_ptr.dtype.element_ty), mask=j < K)
        tl.store(ids_ptr + n * K + j, top_id, mask=j < K)

    @triton.jit
    def _books_kernel(ids_ptr, table_ptr, valid_ptr, slots_ptr, counts_ptr, misses_ptr, R, K, miss_slot,
                      HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < R
        expert = tl.load(ids_ptr + r, mask=ok, other=0)
        slot = tl.load(table_ptr + expert, mask=ok, other=0)
        real = ok
        if HAS_VALID:
            real = ok & (tl.load(valid_ptr + r // K, mask=ok, other=0) != 0)
        tl.store(slots_ptr + r, tl.where(real, slot, -1), mask=ok)
        tl.atomic_add(counts_ptr + expert, tl.where(real, 1.0, 0.0), mask=real)
        missed = tl.sum(tl.where(real & (slot == miss_slot), 1.0, 0.0), 0)
        tl.atomic_add(misses_ptr, missed)
