"""A one-layer KV cache for the paged-kernel tests: its block table a random permutation of the pool (so a kernel
that read a slot's blocks in order, or another slot's, would show) and every column of every slot written with
random keys and values (so a read past a row's causal limit or a span's end would show too)."""

from __future__ import annotations

import torch

from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry


def scrambled_cache(storage: str, dtype: torch.dtype, hkv: int, context_tokens: int, num_slots: int,
                    d: int = 128, seed: int = 0, device: str = "cuda") -> SlotKVCache:
    geo = KVGeometry(num_layers=1, num_slots=num_slots, num_kv_heads=hkv, head_dim=d,
                     context_tokens=context_tokens, margin_tokens=64)
    cache = SlotKVCache(geo, storage, dtype, device)
    perm = torch.randperm(geo.num_blocks, generator=torch.Generator().manual_seed(seed))
    cache.block_table.copy_(perm.view_as(cache.block_table).to(torch.int32))
    gen = torch.Generator(device=device).manual_seed(seed)
    for slot in range(num_slots):
        k, v = (torch.randn(1, hkv, geo.columns, d, device=device, generator=gen, dtype=dtype) for _ in range(2))
        cache.bind(torch.tensor([slot], device=device))
        cache._write(0, k, v, torch.arange(geo.columns, device=device).view(1, -1))
    return cache
