"""What a KV cache holds, before any tensor is made: layers, slots, heads, head size, tokens per slot and per block.

The serving cache (engine.exec.kv.cache.SlotKVCache) is built from a KVGeometry; the setup reads one alone first
(what every slot's whole context would take, the bytes of a block, the paged layout) to check the fit and size the
pool before any pool is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.exec.kv.blocks import BlockLayout

KV_BLOCK_TOKENS = 64  # tokens per pool block: the paged kernel's key tile; divides the tier's 256-token blocks


@dataclass(frozen=True)
class KVGeometry:
    """What a KV cache holds: layers (main + MTP), slots, heads, head size, tokens per slot, tokens per block."""

    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    context_tokens: int
    margin_tokens: int
    block_tokens: int = KV_BLOCK_TOKENS

    @property
    def blocks_per_slot(self) -> int:
        return self.context_blocks + -(-self.margin_tokens // self.block_tokens)

    @property
    def pad_start_tokens(self) -> int:
        """Where padded rows write: the first column of the margin's whole blocks, so no block that holds a
        position < context is ever written by a padded row (with KV by use an unmapped one is the shared scratch)."""
        return self.context_blocks * self.block_tokens

    @property
    def columns(self) -> int:
        """Token positions a slot can address: context + margin, rounded up to whole blocks."""
        return self.blocks_per_slot * self.block_tokens

    @property
    def num_blocks(self) -> int:
        return self.num_slots * self.blocks_per_slot

    @property
    def context_blocks(self) -> int:
        """Logical blocks holding positions < context (those past them are scratch only)."""
        return -(-self.context_tokens // self.block_tokens)

    def layout(self, resident_tokens: int) -> BlockLayout:
        """The paged layout for `--kv-resident`: each slot's first `resident_tokens` (whole blocks) resident."""
        resident = min(self.context_blocks, -(-resident_tokens // self.block_tokens))
        return BlockLayout(self.num_slots, self.blocks_per_slot, self.context_blocks, resident, self.block_tokens)

    def bytes_per_token(self, storage: str, compute_dtype: torch.dtype) -> int:
        """KV bytes one token costs across all layers (keys + values, scales included for int8)."""
        elem = 1 if storage == "int8" else torch.empty((), dtype=compute_dtype).element_size()
        per_head = self.head_dim * elem + (4 if storage == "int8" else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def total_bytes(self, storage: str, compute_dtype: torch.dtype) -> int:
        return self.bytes_per_token(storage, compute_dtype) * self.num_slots * self.columns
