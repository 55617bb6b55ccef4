"""A prompt chunk's attention through a vendor SDPA kernel (cuDNN or flash) over the gathered prefix.

Torch's cuDNN and flash SDPA take contiguous keys with the causal diagonal at the top left, so one chunk at
positions [start, start + T) of one slot is two calls whose outputs merge through their log-sum-exps:

- the chunk's queries over the cached prefix [0, start), no mask;
- the chunk over itself [start, start + T), causal (a square, where top left and bottom right agree).

The prefix is gathered through the block table into query-head order (GQA expanded in the same copy, int8
dequantized in it), `segment_tokens` keys at a time so the copy stays bounded at any depth; each segment's
output merges into the running one. CUDA only. `bench attention --rows prefill --backends cudnn,flash` times it
against the engine's own prefill kernel (engine.model.attention.triton_prefill), which is faster
(docs/MODEL.md, "Why these kernels"), so the engine does not use it.
"""

from __future__ import annotations

from typing import Any

import torch

SDPA_KINDS = ("cudnn", "flash")


def lse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, D], lse [B, H, T] fp32) of q over k, v (same head count), through `kind`'s aten op."""
    if kind == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                 scale=scale)
    elif kind == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        raise ValueError(f"sdpa kind {kind!r}: expected one of {SDPA_KINDS}")
    out, lse = res[0], res[1]
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return out, lse.float()


def merge_into(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
               lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over two disjoint key sets from each one's (out, lse): (out fp32, lse)."""
    if acc is None:
        return out.float(), lse
    acc_out, acc_lse = acc
    top = torch.maximum(acc_lse, lse)
    w_acc, w_new = torch.exp(acc_lse - top), torch.exp(lse - top)
    total = w_acc + w_new
    merged = (acc_out * (w_acc / total).unsqueeze(-1)).add_(out.float() * (w_new / total).unsqueeze(-1))
    return merged, top + torch.log(total)


def gather_heads(kv: Any, layer: int, start: int, end: int,
                 num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, Hq, end - start, D] of the bound slot, each KV head repeated for its query heads, in the
    compute dtype (one gather per pool; int8 dequantized after it)."""
    g = kv.geometry
    bt = g.block_tokens
    first, last = start // bt, -(-end // bt)
    blocks = kv.block_table.index_select(0, kv.slots[:1])[0, first:last].long()  # [n]: no sync, capturable
    heads = torch.arange(num_heads, device=blocks.device) // (num_heads // g.num_kv_heads)
    lo, hi = start - first * bt, end - first * bt

    def gather(pool: torch.Tensor) -> torch.Tensor:  # [Hkv, NB, bt, ...] -> [1, Hq, end - start, ...]
        picked = pool[heads[:, None], blocks[None, :]]  # [Hq, n, bt, ...]
        return picked.reshape(num_heads, -1, *pool.shape[3:])[:, lo:hi].unsqueeze(0)

    kk, vv = gather(kv.k[layer]), gather(kv.v[layer])
    if kv.storage == "int8":
        ks, vs = gather(kv.k_scale[layer]), gather(kv.v_scale[layer])
        return ((kk.to(kv.compute_dtype) * ks.unsqueeze(-1).to(kv.compute_dtype)),
                (vv.to(kv.compute_dtype) * vs.unsqueeze(-1).to(kv.compute_dtype)))
    return kk.contiguous(), vv.contiguous()


def sdpa_prefill_attention(kv: Any, layer: int, q: torch.Tensor, start: int, kind: str,
                           segment_tokens: int) -> torch.Tensor:
    """One row's chunk q [1, Hq, T, D] at positions [start, start + T) over its slot's keys -> [1, Hq, T, D].
    The chunk's own keys must already be in the pool (the cache writes them before it attends)."""
    t, hq, d = q.shape[2], q.shape[1], q.shape[3]
    scale = d ** -0.5
    acc = None
    for seg in range(0, start, segment_tokens):
        kk, vv = gather_heads(kv, layer, seg, min(start, seg + segment_tokens), hq)
        acc = merge_into(acc, *lse_attention(q, kk, vv, False, scale, kind))
    kk, vv = gather_heads(kv, layer, start, start + t, hq)
    acc = merge_into(acc, *lse_attention(q, kk, vv, True, scale, kind))
    return acc[0].to(q.dtype)
