"""Host memory for spilled KV blocks (`--kv-resident`): one tensor per device pool tensor, block-indexed like it.

Per pool tensor `[Hkv, blocks, block_tokens(, D)]` (keys, values, and for int8 their scales) a host tensor of the
same layout, pinned on CUDA so the copies are DMA transfers. It grows by doubling (a copy of what it holds) and
never shrinks: spilled memory is reused through the ledger's free host blocks.

A copy's blocks are scattered on both sides, so each one goes through a staging buffer per pool tensor: pinned
host memory that is kept and grown by doubling, where the host side is gathered (fetch) or landed (spill) in one
contiguous DMA transfer. Pinning a fresh buffer per copy (cudaHostAlloc on every forward that fetched) and
spilling into pageable memory were what the first version did.
"""

from __future__ import annotations

import math

import torch

MIB = float(1 << 20)
_MIN_HOST_BLOCKS = 16


class HostKVStore:
    """Host copies of pool blocks, addressed by host block id (engine.exec.kv_blocks.BlockLedger hands them out)."""

    def __init__(self, pools: list[torch.Tensor], pinned: bool) -> None:
        self._like = [(tuple(p.shape), p.dtype) for p in pools]
        self.pinned = pinned
        self.capacity_blocks = 0
        self.tensors: list[torch.Tensor] = []
        # Staging (flat, viewed as [Hkv, n, ...] contiguous per copy) and the event after the last copy that read
        # or wrote it: the next copy waits for it before it reuses the buffer.
        self._staging: list[torch.Tensor] = []
        self._staging_blocks = 0
        self._staged: torch.cuda.Event | None = None

    @property
    def mib(self) -> float:
        """Host memory allocated (held and free blocks)."""
        return sum(t.numel() * t.element_size() for t in self.tensors) / MIB

    def ensure(self, blocks: int) -> None:
        """Room for host block ids [0, blocks)."""
        if blocks <= self.capacity_blocks:
            return
        cap = max(blocks, 2 * self.capacity_blocks, _MIN_HOST_BLOCKS)
        grown = []
        for i, (shape, dtype) in enumerate(self._like):
            t = torch.empty((shape[0], cap, *shape[2:]), dtype=dtype, pin_memory=self.pinned)
            if self.tensors:
                t[:, : self.capacity_blocks].copy_(self.tensors[i])
            grown.append(t)
        self.tensors = grown
        self.capacity_blocks = cap

    def spill(self, pools: list[torch.Tensor], device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device pool blocks into host blocks (synchronously: the freed device blocks are reused next)."""
        src = torch.tensor(device_ids, dtype=torch.long, device=pools[0].device)
        dst = torch.tensor(host_ids, dtype=torch.long)
        views = self._staging_views(len(device_ids))
        for pool, view in zip(pools, views):
            view.copy_(pool.index_select(1, src), non_blocking=self.pinned)
        self._record(pools[0].device)
        if self._staged is not None:
            self._staged.synchronize()  # the host copy below reads what the transfers landed
        for host, view in zip(self.tensors, views):
            host.index_copy_(1, dst, view)

    def fetch(self, pools: list[torch.Tensor], host_ids: list[int], device_ids: list[int]) -> None:
        """Copy host blocks into device pool blocks (stream-ordered before the forward that reads them)."""
        src = torch.tensor(host_ids, dtype=torch.long)
        dst = torch.tensor(device_ids, dtype=torch.long, device=pools[0].device)
        views = self._staging_views(len(host_ids))
        for pool, host, view in zip(pools, self.tensors, views):
            torch.index_select(host, 1, src, out=view)
            pool.index_copy_(1, dst, view.to(pool.device, non_blocking=self.pinned))
        self._record(pools[0].device)

    def _staging_views(self, blocks: int) -> list[torch.Tensor]:
        """One contiguous `[Hkv, blocks, ...]` view per pool tensor into the staging buffers, once the last copy
        through them is done."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None
        if blocks > self._staging_blocks:
            cap = max(blocks, 2 * self._staging_blocks, _MIN_HOST_BLOCKS)
            self._staging = [torch.empty(shape[0] * cap * math.prod(shape[2:]), dtype=dtype, pin_memory=self.pinned)
                             for shape, dtype in self._like]
            self._staging_blocks = cap
        return [buf[: shape[0] * blocks * math.prod(shape[2:])].view(shape[0], blocks, *shape[2:])
                for buf, (shape, _) in zip(self._staging, self._like)]

    def _record(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(device))

    def free(self) -> None:
        self.tensors = []
        self.capacity_blocks = 0
        self._staging = []
        self._staging_blocks = 0
