"""Where one forward's keys and values of one layer go in the paged KV pool: what a kernel that writes them
itself needs (FUSED_OPS' q/k norm + RoPE kernel), handed out by the serving cache
(engine.exec.kv.cache.SlotKVCache.write_site) once the layer's blocks are on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSite:
    """The layer's pools [Hkv, num_blocks, block_tokens, D] (int8 with float32 scales [Hkv, num_blocks,
    block_tokens], else None) and each (row, token)'s physical block and offset [B, T]."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    blocks: torch.Tensor
    offsets: torch.Tensor
