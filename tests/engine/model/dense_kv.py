"""DenseKVCache: the simple contiguous KV cache the model tests run the model over (an independent KV
implementation beside the engine's paged one).

One [B, Hkv, max_tokens, D] buffer pair per layer (main layers 0..L-1, MTP layers L..). `attend` writes the
new k/v at their positions and attends causally by position, so rewinding (after rejected draft tokens) needs
no bookkeeping: later writes overwrite, and the mask never reads past the query's own position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig


class DenseKVCache:
    """Per-layer contiguous K/V buffers implementing `attend(layer_idx, q, k, v, positions)`."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size <= 0 or max_tokens <= 0 or num_layers <= 0:
            raise ValueError(
                f"DenseKVCache needs positive sizes: num_layers={num_layers}, batch_size={batch_size}, "
                f"max_tokens={max_tokens}"
            )
        shape = (batch_size, num_kv_heads, max_tokens, head_dim)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        batch_size: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "DenseKVCache":
        """A cache with room for every main and MTP layer of `config`."""
        return cls(config.num_kv_layers, batch_size, max_tokens, config.num_key_value_heads, config.head_dim, dtype, device)

    @property
    def num_layers(self) -> int:
        """Layers with K/V buffers (main + MTP)."""
        return len(self.k)

    def nbytes(self) -> int:
        """Bytes held by all K and V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v [B, Hkv, T, D] at `positions` [B, T], attend q [B, Hq, T, D] causally -> [B, Hq, T, D]."""
        if not 0 <= layer_idx < len(self.k):
            raise IndexError(f"layer_idx={layer_idx}: this cache has {len(self.k)} layers")
        B, _, T, _ = q.shape
        if B > self.batch_size:
            raise ValueError(f"batch of {B} rows, but this cache holds {self.batch_size}")
        # One host sync per call; this cache is the simple path, the serving KV avoids it.
        end_tokens = int(positions.max().item()) + 1
        if end_tokens > self.max_tokens or int(positions.min().item()) < 0:
            raise ValueError(f"positions reach {end_tokens - 1}; this cache holds positions 0..{self.max_tokens - 1}")
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        rows = torch.arange(B, device=positions.device)[:, None]  # [B, 1]
        # Index the token axis through a [B, S, Hkv, D] view so one index_put writes every row's positions.
        k_cache.transpose(1, 2)[rows, positions] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache.transpose(1, 2)[rows, positions] = v.transpose(1, 2).to(v_cache.dtype)
        keys = k_cache[:B, :, :end_tokens].to(q.dtype)
        values = v_cache[:B, :, :end_tokens].to(q.dtype)
        key_pos = torch.arange(end_tokens, device=q.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, S]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
