"""Attention backends: how the model's attention reads the serving KV cache.

The cache (engine.exec.kv.cache.SlotKVCache) is storage: a block pool per layer, a block table per slot, and
the binding of one forward (`slots`, `span_tokens`, `causal_keys`, `split_attn`). A backend turns the bound
cache and the queries into the attention output:

- `TorchAttention`: the reference. Reads each row's keys through the block table into a contiguous copy
  (`kv.read`), then masked SDPA, the split-KV (flash-decoding) path, the blocked online softmax for long reads,
  or fused causal SDPA for prompt chunks. Runs everywhere; CPU results and the tests' oracle.
- `TritonPagedAttention`: on CUDA, decode, MTP verify and drafting steps (at most `MAX_KERNEL_QUERIES` tokens
  per row) read the pool in place through the block table with the split-K decode kernel
  (engine.model.attention.triton_paged); with PAGED_PREFILL on, prompt chunks too, with the flash prefill
  kernel over the cached prefix and the chunk (engine.model.attention.triton_prefill); anything else falls
  back to the reference. fp32 runs with exact (IEEE) fp32 dots. CUDA with Triton only (`kernel_backend()`
  says whether it can run).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.model.attention.reference import OnlineSoftmax, causal_mask, masked_sdpa, scores_bytes, split_kv_attention

MAX_KERNEL_QUERIES = 8
_MIN_BLOCK_TOKENS = 256


class TorchAttention:
    """Gather + SDPA (and its blocked / split variants): the reference backend."""

    name = "torch"

    def __init__(self) -> None:
        self._mask: tuple | None = None  # (positions, shape, span, group, dtype, mask) of the forward bound last

    def reset(self) -> None:
        """A new forward was bound: forget the mask of the last one."""
        self._mask = None

    def attend(self, kv: Any, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, D] over the keys `kv` holds for its bound slots -> [B, Hq, T, D]."""
        slots, span, t = kv.slots, kv.span_tokens, q.shape[2]
        if kv.causal_keys is not None:  # bound by bind_chunk, when chunk_fusable said yes
            kk, vv = kv.read(layer, slots, 0, kv.causal_keys)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=causal_lower_right(t, kk.shape[2]),
                                                  enable_gqa=q.shape[1] != kk.shape[1])
        if kv.split_attn and t <= MAX_KERNEL_QUERIES and span > kv.split_tokens:
            kk, vv = kv.read(layer, slots, 0, span)  # the switch's cost: scratch that grows with context
            return split_kv_attention(q, kk, vv, positions, kv.split_tokens)
        if kv.gather_bytes(q, span) > kv.block_kv_bytes:
            return self._blocked(kv, layer, q, positions, span)
        if t > MAX_KERNEL_QUERIES and scores_bytes(q, span) > kv.block_scores_bytes:
            return self._query_blocked(kv, layer, q, positions, span)
        kk, vv = kv.read(layer, slots, 0, span)
        return masked_sdpa(q, kk, vv, positions, self._mask_for(kv, q, positions, span))

    def _mask_for(self, kv: Any, q: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """masked_sdpa's causal-by-position mask, built by the first layer of a forward and reused by the rest
        (every layer of one forward has the same positions and span: two kernels saved per layer)."""
        key = (positions, positions.shape, span, q.shape[1] // kv.geometry.num_kv_heads, q.dtype)
        if self._mask is None or self._mask[0] is not positions or self._mask[1:-1] != key[1:]:
            # Additive (0 / -inf) in the compute dtype: SDPA would otherwise convert a bool mask in every layer.
            visible = causal_mask(positions, key[3], span)
            additive = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
            self._mask = (*key, additive)
        return self._mask[-1]

    def _query_blocked(self, kv: Any, layer: int, q: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """A long chunk whose keys fit one copy but whose scores do not: SDPA over the keys for one block of
        queries at a time. The online softmax over key blocks (`_blocked`) bounds the same memory, but its
        elementwise fp32 passes made a CPU chunk five times slower than SDPA over the same keys."""
        t = q.shape[2]
        kk, vv = kv.read(layer, kv.slots, 0, span)
        rows = max(MAX_KERNEL_QUERIES, kv.block_scores_bytes // max(1, scores_bytes(q[:, :, :1], span)))
        pieces = [masked_sdpa(q[:, :, i:i + rows], kk, vv, positions[:, i:i + rows]) for i in range(0, t, rows)]
        return torch.cat(pieces, dim=2)

    def _blocked(self, kv: Any, layer: int, q: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        b, hq, t, d = q.shape
        by_scores = kv.block_scores_bytes // max(1, b * hq * t * 4)
        by_copy = kv.block_kv_bytes // max(1, kv.gather_bytes(q, 1))
        block = max(_MIN_BLOCK_TOKENS, min(by_scores, by_copy))
        state = OnlineSoftmax.start(q, kv.geometry.num_kv_heads, positions)
        for start in range(0, span, block):
            end = min(span, start + block)
            kk, vv = kv.read(layer, kv.slots, start, end)
            state.update(kk, vv, start)
        return state.finish()


class TritonPagedAttention(TorchAttention):
    """Few-query steps through the in-place decode kernel; prompt chunks through the prefill kernel when the
    forward's path says so (PAGED_PREFILL), else through the reference."""

    name = "triton"

    def attend(self, kv: Any, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.runs_on(q) or (q.shape[2] > MAX_KERNEL_QUERIES and not kv.paged_prefill):
            return super().attend(kv, layer, q, positions)
        return self.paged(kv, layer, q, positions)

    def runs_on(self, q: torch.Tensor) -> bool:
        """Where the compiled kernels run (the interpreter tests say yes on CPU)."""
        return q.is_cuda

    def paged(self, kv: Any, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The kernels on any device Triton runs on (its interpreter runs them on CPU tensors in the tests).

        Both kernels apply the causal-by-position rule, so a chunk bound by `bind_chunk` needs nothing of its
        `causal_keys`: the bottom-right-aligned set it names is each query's causal set."""
        scales = kv.scales(layer)
        args = (kv.block_table, kv.slots, positions, kv.span_tokens, kv.geometry.context_tokens)
        if q.shape[2] <= MAX_KERNEL_QUERIES:
            from engine.model.attention.triton_paged import paged_decode_attention

            return paged_decode_attention(q, kv.k[layer], kv.v[layer], *scales, *args)
        from engine.model.attention.triton_prefill import paged_prefill_attention

        return paged_prefill_attention(q, kv.k[layer], kv.v[layer], *scales, *args)


def triton_runs(device: torch.device) -> bool:
    """Whether compiled Triton kernels run on `device`: a CUDA device and an importable Triton."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_backend(device: torch.device) -> TritonPagedAttention | None:
    """The paged-kernel backend where it can run, else None."""
    return TritonPagedAttention() if triton_runs(device) else None
