"""The serving KV cache: per-layer slot buffers, bf16/int8 storage, and the attention the model calls.

Layout per layer: `k[layer]`, `v[layer]` are `[slots, Hkv, context + margin, D]`. The `margin` columns past
`context` are scratch: padded batch rows (a batch padded up to its bucket, a prefill chunk padded up to its
length bucket) write there, so every forward has static shapes and no padded row ever touches a real token.
Validity needs no length tensor: a query at position p sees keys 0..p of its slot, so KV left behind by a
rejected draft or an earlier request is simply never visible and is overwritten when its position is reused.

`--kv int8` stores keys and values as int8 with one float32 scale per (token, head), written at quantization
time; reads dequantize block by block. `--kv bf16` stores unquantized KV in the model's compute dtype (bf16 on
GPU; fp32 when a CPU run keeps fp32 weights, so the lossless tests compare like with like).

Three attention paths, all pure tensor code of static shapes (capturable):
- decode/verify (few queries): plain masked SDPA over the slot's length bucket;
- SPLIT_ATTN decode: flash-decoding split-KV: partial softmaxes per KV split, combined; scratch grows with L;
- long prefill chunks: a loop over KV blocks with an online softmax, so [chunk x context] scores for all
  heads are never materialized at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

KV_STORAGE = ("bf16", "int8")
# Scores scratch one blocked-attention step may use (B x Hq x T x block x 4 bytes).
_BLOCK_SCORES_BYTES = 256 << 20
# Keys + values one read may copy (gathered by slot, dequantized): longer spans are read block by block.
_BLOCK_KV_BYTES = 128 << 20
_MIN_BLOCK_TOKENS = 256
_SPLIT_TOKENS = 1024  # keys per split in the split-KV decode path
_INT8_MAX = 127.0


@dataclass(frozen=True)
class KVGeometry:
    """What a KV cache holds: layers (main + MTP), slots, heads, head size, tokens per slot."""

    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    context_tokens: int
    margin_tokens: int

    @property
    def columns(self) -> int:
        return self.context_tokens + self.margin_tokens

    def bytes_per_token(self, storage: str, compute_dtype: torch.dtype) -> int:
        """KV bytes one token costs across all layers (keys + values, scales included for int8)."""
        elem = 1 if storage == "int8" else torch.empty((), dtype=compute_dtype).element_size()
        per_head = self.head_dim * elem + (4 if storage == "int8" else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def total_bytes(self, storage: str, compute_dtype: torch.dtype) -> int:
        return self.bytes_per_token(storage, compute_dtype) * self.num_slots * self.columns


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) symmetric int8: x [..., D] -> (int8 [..., D], float32 scale [...])."""
    scale = x.abs().amax(dim=-1).float().clamp(min=1e-8) / _INT8_MAX
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


class SlotKVCache:
    """KV for `num_slots` sequences of up to `context_tokens` each; implements the model's `kv.attend`.

    Before each forward the step function calls `bind(slots)` with a [B] long tensor naming the slot of each
    batch row, and `set_split(on)` for the SPLIT_ATTN path. Positions arrive with each `attend` call.
    """

    def __init__(self, geometry: KVGeometry, storage: str, compute_dtype: torch.dtype, device: torch.device | str) -> None:
        if storage not in KV_STORAGE:
            raise ValueError(f"kv storage {storage!r}: expected one of {KV_STORAGE}")
        self.geometry = geometry
        self.storage = storage
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        g = geometry
        shape = (g.num_slots, g.num_kv_heads, g.columns, g.head_dim)
        data_dtype = torch.int8 if storage == "int8" else compute_dtype
        self.k = [torch.zeros(shape, dtype=data_dtype, device=self.device) for _ in range(g.num_layers)]
        self.v = [torch.zeros(shape, dtype=data_dtype, device=self.device) for _ in range(g.num_layers)]
        if storage == "int8":
            sshape = shape[:-1]
            self.k_scale = [torch.ones(sshape, dtype=torch.float32, device=self.device) for _ in range(g.num_layers)]
            self.v_scale = [torch.ones(sshape, dtype=torch.float32, device=self.device) for _ in range(g.num_layers)]
        else:
            self.k_scale = self.v_scale = []
        self._slots: torch.Tensor | None = None
        self._span = geometry.context_tokens
        self.split_attn = False
        # Tunable so tests reach the blocked and split paths at small sizes.
        self.block_scores_bytes = _BLOCK_SCORES_BYTES
        self.block_kv_bytes = _BLOCK_KV_BYTES
        self.split_tokens = _SPLIT_TOKENS
        self.fused_prefill: bool | None = None  # None: decide per device (flash on CUDA), see chunk_fusable
        self._causal_keys: int | None = None
        self._mask: tuple | None = None  # (positions, shape, span, group, mask) of the forward bound last
        self._fusable: dict[tuple[int, int], bool] = {}

    # --- accounting ----------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        tensors = self.k + self.v + list(self.k_scale) + list(self.v_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def mib(self) -> float:
        return self.nbytes / (1 << 20)

    # --- the model-facing seam -----------------------------------------------------------------------------

    def bind(self, slots: torch.Tensor, span_tokens: int | None = None, causal_keys: int | None = None) -> None:
        """Name each batch row's slot ([B] long tensor) and the key span (length bucket) to read.

        The span is a static int (part of the executor key); None reads every column that can be valid.
        """
        self._slots = slots
        self._span = self.geometry.context_tokens if span_tokens is None else int(span_tokens)
        self._causal_keys = causal_keys
        self._mask = None

    def bind_chunk(self, slots: torch.Tensor, span_tokens: int, start: int, chunk_bucket: int) -> None:
        """bind() for one prompt chunk padded at its end: positions [start, start + chunk_bucket).

        Lets long chunks use fused causal attention aligned to the bottom right: over keys [0, start +
        chunk_bucket), query row i sees keys <= start + i, which is exactly its causal set (the pad rows at
        the end see stale keys, and their outputs are never used). `start` is baked into the step, so the
        runner puts it in the executor key.
        """
        self.bind(slots, span_tokens)
        self._causal_keys = int(start) + int(chunk_bucket)

    def free(self) -> None:
        """Drop every K/V buffer (Engine.close); the cache cannot be used afterwards."""
        self.k, self.v, self.k_scale, self.v_scale = [], [], [], []
        self._slots = self._mask = None

    def set_split(self, enabled: bool) -> None:
        self.split_attn = bool(enabled)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write k, v at `positions` of each row's slot, then attend causally. q [B,Hq,T,D] -> [B,Hq,T,D]."""
        assert self._slots is not None, "SlotKVCache.bind(slots) must precede the forward"
        slots = self._slots
        self._write(layer_idx, slots, k, v, positions)
        span = self._span
        t = q.shape[2]
        if self._causal_keys is not None:  # bound by bind_chunk, when chunk_fusable said yes
            kk, vv = self._read(layer_idx, slots, 0, self._causal_keys)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=causal_lower_right(t, kk.shape[2]),
                                                  enable_gqa=q.shape[1] != kk.shape[1])
        if self.split_attn and t <= 8 and span > self.split_tokens:
            kk, vv = self._read(layer_idx, slots, 0, span)  # the switch's cost: scratch that grows with context
            return split_kv_attention(q, kk, vv, positions, self.split_tokens)
        if (t > 8 and _scores_bytes(q, span) > self.block_scores_bytes) or self._gather_bytes(q, span) > self.block_kv_bytes:
            return self._blocked(layer_idx, q, slots, positions, span)
        kk, vv = self._read(layer_idx, slots, 0, span)
        return masked_sdpa(q, kk, vv, positions, self._mask_for(q, positions, span))

    def _mask_for(self, q: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """masked_sdpa's causal-by-position mask, built by the first layer of a forward and reused by the rest
        (every layer of one forward has the same positions and span: two kernels saved per layer)."""
        key = (positions, positions.shape, span, q.shape[1] // self.geometry.num_kv_heads, q.dtype)
        if self._mask is None or self._mask[0] is not positions or self._mask[1:-1] != key[1:]:
            # Additive (0 / -inf) in the compute dtype: SDPA would otherwise convert a bool mask in every layer.
            visible = causal_mask(positions, key[3], span)
            additive = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
            self._mask = (*key, additive)
        return self._mask[-1]

    def _gather_bytes(self, q: torch.Tensor, n_keys: int) -> int:
        """Bytes of the dequantized key + value copy one read of `n_keys` keys for this batch makes."""
        return 2 * q.shape[0] * self.geometry.num_kv_heads * n_keys * self.geometry.head_dim * q.element_size()

    def chunk_fusable(self, num_heads: int, chunk_tokens: int) -> bool:
        """Whether a prompt chunk may use fused (flash) causal attention through `bind_chunk`: on CUDA when the
        flash kernel accepts the shapes and dtype (otherwise torch would materialize the whole mask, so the
        blocked path is used instead). `fused_prefill` True forces it (tests on CPU), False disables it."""
        if self.fused_prefill is not None:
            return self.fused_prefill
        if self.device.type != "cuda" or chunk_tokens <= 8:
            return False
        key = (num_heads, chunk_tokens)
        if key not in self._fusable:
            g = self.geometry
            q = torch.zeros(1, num_heads, chunk_tokens, g.head_dim, dtype=self.compute_dtype, device=self.device)
            k = torch.zeros(1, g.num_kv_heads, 1, g.head_dim, dtype=self.compute_dtype, device=self.device)
            self._fusable[key] = _flash_accepts(q, k)
        return self._fusable[key]

    # --- storage -------------------------------------------------------------------------------------------

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        b, _, t, _ = k.shape
        rows = slots.view(b, 1).expand(b, t)
        k_tok = k.transpose(1, 2)  # [B, T, Hkv, D]: advanced indices (rows, positions) come first
        v_tok = v.transpose(1, 2)
        if self.storage == "int8":
            kq, ks = quantize_int8(k_tok)
            vq, vs = quantize_int8(v_tok)
            self.k[layer][rows, :, positions] = kq
            self.v[layer][rows, :, positions] = vq
            self.k_scale[layer][rows, :, positions] = ks
            self.v_scale[layer][rows, :, positions] = vs
        else:
            self.k[layer][rows, :, positions] = k_tok.to(self.compute_dtype)
            self.v[layer][rows, :, positions] = v_tok.to(self.compute_dtype)

    def _read(self, layer: int, slots: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, end-start, D] of each row's slot, dequantized to the compute dtype."""
        kk = self.k[layer][:, :, start:end].index_select(0, slots)
        vv = self.v[layer][:, :, start:end].index_select(0, slots)
        if self.storage == "int8":
            ks = self.k_scale[layer][:, :, start:end].index_select(0, slots)
            vs = self.v_scale[layer][:, :, start:end].index_select(0, slots)
            return dequantize_int8(kk, ks, self.compute_dtype), dequantize_int8(vv, vs, self.compute_dtype)
        return kk, vv

    def _blocked(self, layer: int, q: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        b, hq, t, d = q.shape
        by_scores = self.block_scores_bytes // max(1, b * hq * t * 4)
        by_copy = self.block_kv_bytes // max(1, self._gather_bytes(q, 1))
        block = max(_MIN_BLOCK_TOKENS, min(by_scores, by_copy))
        state = OnlineSoftmax.start(q, self.geometry.num_kv_heads, positions)
        for start in range(0, span, block):
            end = min(span, start + block)
            kk, vv = self._read(layer, slots, start, end)
            state.update(kk, vv, start)
        return state.finish()

    # --- whole-slot copies: prefix blocks in and out of the tier -------------------------------------------

    def read_span(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All layers' KV of one slot's tokens [start, end): data [layers, 2, Hkv, n, D], int8 scales or None."""
        data = torch.stack([torch.stack([self.k[i][slot, :, start:end], self.v[i][slot, :, start:end]])
                            for i in range(self.geometry.num_layers)])
        if self.storage != "int8":
            return data, None
        scales = torch.stack([torch.stack([self.k_scale[i][slot, :, start:end], self.v_scale[i][slot, :, start:end]])
                              for i in range(self.geometry.num_layers)])
        return data, scales

    def write_span(self, slot: int, start: int, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        """The inverse of read_span: put a [layers, 2, Hkv, n, D] span at tokens [start, start+n) of `slot`."""
        n = data.shape[3]
        for i in range(self.geometry.num_layers):
            self.k[i][slot, :, start:start + n].copy_(data[i, 0], non_blocking=True)
            self.v[i][slot, :, start:start + n].copy_(data[i, 1], non_blocking=True)
            if scales is not None:
                self.k_scale[i][slot, :, start:start + n].copy_(scales[i, 0], non_blocking=True)
                self.v_scale[i][slot, :, start:start + n].copy_(scales[i, 1], non_blocking=True)


def _flash_accepts(q: torch.Tensor, k: torch.Tensor) -> bool:
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, False, q.shape[1] != k.shape[1])))
    except Exception:  # noqa: BLE001 - an API difference means "not sure": take the blocked path
        return False


def _scores_bytes(q: torch.Tensor, span: int) -> int:
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
