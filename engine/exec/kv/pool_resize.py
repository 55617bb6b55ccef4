"""Reallocating one KV pool tensor to a new block count (SlotKVCache.resize_pool: `--kv-resident` growth and the
shared tier's resize), through host memory when the device cannot hold old and new at once. Torch only: it knows
nothing of the cache that owns the tensors."""

from __future__ import annotations

import torch


def resized(pools: list[torch.Tensor], i: int, num_blocks: int, fill: float, stage: bool) -> torch.Tensor:
    """pools[i] with `num_blocks` blocks on axis 1, its first blocks kept. With `stage`, when the device cannot
    hold the new tensor next to the old one (a shrink the out-of-memory path asked for), the kept part goes
    through host memory: the old tensor is freed before the new one is allocated."""
    old = pools[i]
    device, dtype = old.device, old.dtype
    keep = min(num_blocks, old.shape[1])
    shape = (old.shape[0], num_blocks, *old.shape[2:])
    try:
        new = empty(shape, dtype, device)
        new[:, :keep].copy_(old[:, :keep])
    except torch.OutOfMemoryError:
        if not stage:
            raise
        host = old[:, :keep].to("cpu", copy=True)
        pools[i] = old = None  # the last reference: its memory is free for the smaller tensor
        if device.type == "cuda":
            torch.cuda.empty_cache()
        new = empty(shape, dtype, device)
        new[:, :keep].copy_(host)
    if num_blocks > keep:
        new[:, keep:].fill_(fill)
    return new


def empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The one allocation of a pool reallocation (a seam the tests inject out-of-memory errors into)."""
    return torch.empty(shape, dtype=dtype, device=device)
