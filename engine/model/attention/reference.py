"""Plain-PyTorch attention over keys already read from the KV cache: the CPU path and the kernels' oracle.

Every function takes keys and values as `[B, Hkv, L, D]` (gathered from the pool by the cache) and queries as
`[B, Hq, T, D]`; a query at position p sees keys 0..p (the causal-by-position rule), so stale KV past a
rolled-back position is never visible. GQA folds each KV head's query group into the query axis
(`[B, Hkv, G*T, D]`): keys are never repeated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def flash_accepts(q: torch.Tensor, k: torch.Tensor) -> bool:
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, False, q.shape[1] != k.shape[1])))
    except Exception:  # noqa: BLE001 - an API difference means "not sure": take the blocked path
        return False


def scores_bytes(q: torch.Tensor, span: int) -> int:
    b, hq, t, _ = q.shape
    return b * hq * t * span * 4


def causal_mask(positions: torch.Tensor, group: int, span: int) -> torch.Tensor:
    """[B, 1, G*T, L] bool: query row (g, t) may see key j when j <= positions[b, t] (masked_sdpa's layout).
    Every row sees key 0 (positions are >= 0), so no row of the mask is all False."""
    b, t = positions.shape
    pos = positions.view(b, 1, t).expand(b, group, t).reshape(b, 1, group * t)
    keys = torch.arange(span, device=positions.device)
    return keys.view(1, 1, 1, -1) <= pos.unsqueeze(-1)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Plain SDPA over keys [0, L) with the causal-by-position mask (`causal_mask`, built here when not given).

    GQA by folding each KV head's query group into the query axis ([B, Hkv, G*T, D]): keys are never repeated,
    and SDPA's own enable_gqa is avoided (on CPU it falls back to a much slower path).
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * t, d)
    if mask is None:
        mask = causal_mask(positions, g, k.shape[2])
    out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
    return out.reshape(b, hq, t, d)


class OnlineSoftmax:
    """Running (max, sum, accumulator) of softmax attention over KV blocks seen so far, per query row.

    Queries are grouped by KV head ([B, Hkv, G*T, D]) so keys are never repeated for GQA.
    """

    def __init__(self, q: torch.Tensor, pos: torch.Tensor, shape: tuple[int, int, int, int]) -> None:
        # Matmuls stay in the compute dtype (tensor cores on GPU, fp32 accumulation); softmax state is fp32.
        self.q, self.pos, self.shape = q, pos, shape
        self.out_dtype = q.dtype
        b, hkv, gt, d = q.shape
        self.m = torch.full((b, hkv, gt), float("-inf"), dtype=torch.float32, device=q.device)
        self.l = torch.zeros((b, hkv, gt), dtype=torch.float32, device=q.device)
        self.acc = torch.zeros((b, hkv, gt, d), dtype=torch.float32, device=q.device)
        self.scale = 1.0 / math.sqrt(d)

    @classmethod
    def start(cls, q: torch.Tensor, num_kv_heads: int, positions: torch.Tensor) -> "OnlineSoftmax":
        b, hq, t, d = q.shape
        g = hq // num_kv_heads
        qg = q.reshape(b, num_kv_heads, g * t, d)  # heads h*g..h*g+g-1 share KV head h
        pos = positions.view(b, 1, 1, t).expand(b, 1, g, t).reshape(b, 1, g * t)
        return cls(qg, pos, (b, hq, t, d))

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        s = torch.matmul(self.q, k.to(self.q.dtype).transpose(-1, -2)).float() * self.scale  # [B, Hkv, GT, n]
        keys = torch.arange(start, start + k.shape[2], device=k.device)
        s = s.masked_fill(keys.view(1, 1, 1, -1) > self.pos.unsqueeze(-1), float("-inf"))
        m_new = torch.maximum(self.m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - m_safe)  # exp(-inf) = 0 while nothing was visible yet
        p = torch.exp(s - m_safe.unsqueeze(-1))
        self.l = self.l * alpha + p.sum(dim=-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + torch.matmul(p.to(self.q.dtype), v.to(self.q.dtype)).float()
        self.m = m_new

    def finish(self) -> torch.Tensor:
        b, hq, t, d = self.shape
        out = self.acc / self.l.clamp(min=1e-30).unsqueeze(-1)
        return out.reshape(b, hq, t, d).to(self.out_dtype)


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       split_tokens: int) -> torch.Tensor:
    """Flash-decoding: attend each KV split in parallel, then combine the partial softmaxes.

    Its scratch (partial max/sum/accumulator per split) grows with the key span: that is the switch's cost.
    """
    b, hq, t, d = q.shape
    hkv, span = k.shape[1], k.shape[2]
    g = hq // hkv
    n_split = -(-span // split_tokens)
    pad = n_split * split_tokens - span
    if pad:
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    qg = q.reshape(b, hkv, 1, g * t, d).float()
    ks = k.reshape(b, hkv, n_split, split_tokens, d).float()
    vs = v.reshape(b, hkv, n_split, split_tokens, d).float()
    s = torch.matmul(qg, ks.transpose(-1, -2)) / math.sqrt(d)  # [B, Hkv, S, GT, split]
    keys = torch.arange(n_split * split_tokens, device=q.device).view(1, 1, n_split, 1, split_tokens)
    pos = positions.view(b, 1, 1, t).expand(b, 1, g, t).reshape(b, 1, 1, g * t, 1)
    s = s.masked_fill(keys > pos, float("-inf"))
    m = s.amax(dim=-1)  # [B, Hkv, S, GT]
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe.unsqueeze(-1))
    l_part = p.sum(dim=-1)
    acc_part = torch.matmul(p, vs)  # [B, Hkv, S, GT, D]
    m_all = m.amax(dim=2, keepdim=True)
    w = torch.exp(m - m_all)  # splits with no visible key get weight 0
    w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
    l_all = (l_part * w).sum(dim=2)
    acc = (acc_part * w.unsqueeze(-1)).sum(dim=2)
    out = acc / l_all.clamp(min=1e-30).unsqueeze(-1)
    return out.reshape(b, hq, t, d).to(q.dtype)
