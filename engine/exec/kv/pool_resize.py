"""Reallocating the KV pool tensors to a new block count (SlotKVCache.resize_pool: KV by use's growth and the
shared tier's resize), one at a time, all or nothing, through host memory when the device cannot hold old and new
at once. Torch only: it knows nothing of the cache that owns the tensors."""

from __future__ import annotations

from typing import Iterable

import torch


def resize_all(groups: Iterable[tuple[list[torch.Tensor], float]], num_blocks: int, stage: bool) -> None:
    """Every tensor of `groups` ((pools, fill of new blocks) pairs) to `num_blocks` blocks, all or nothing: a
    growth that runs out of memory part-way puts the tensors that grew back (through host memory) and raises.
    Left part-way, a layer's keys would have more blocks than its values, and the kernels, which address the
    values with the keys' strides (the value scales with the key scales'), would read and write past the value
    tensor's end. A tensor already at the size is left alone."""
    groups = list(groups)
    before = min((pools[0].shape[1] for pools, _ in groups if pools), default=0)
    try:
        _resize_each(groups, num_blocks, stage)
    except torch.OutOfMemoryError:
        if num_blocks <= before:
            raise
        _resize_each(groups, before, stage=True)  # a shrink to the blocks every tensor still has
        raise


def _resize_each(groups: list[tuple[list[torch.Tensor], float]], num_blocks: int, stage: bool) -> None:
    for pools, fill in groups:
        for i in range(len(pools)):
            if pools[i].shape[1] != num_blocks:
                pools[i] = resized(pools, i, num_blocks, fill, stage)


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
