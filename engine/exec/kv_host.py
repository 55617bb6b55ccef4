"""Host memory for spilled KV blocks (`--kv-resident`): one tensor per device pool tensor, block-indexed like it.

Per pool tensor `[Hkv, blocks, block_tokens(, D)]` (keys, values, and for int8 their scales) a host tensor of the
same layout, pinned on CUDA so the copies are DMA transfers. It grows by doubling (a copy of what it holds) and
never shrinks: spilled memory is reused through the ledger's free host blocks.

A copy's blocks are scattered on both sides, so each one goes through a staging buffer per pool tensor: pinned
host memory that is kept and grown by doubling, where the host side is gathered (fetch) or landed (spill) in one
contiguous DMA transfer. Pinning a fresh buffer per copy (cudaHostAlloc on every forward that fetched) and
spilling into pageable memory were what the first version did.

A spill is synchronous (the device blocks it frees are reused at once). A fetch is enqueued on whatever stream is
current, one group of pool tensors (one layer's) after another, and returns without waiting: on CUDA the caller
(engine.exec.kv_paging) runs it on its copy stream and records a layer's event after each group. The staging
buffers stay correct across streams: the event after a copy is recorded on the stream that ran it, and the next
copy waits for it on the host before it writes the buffers again.
"""

from __future__ import annotations

import math
from typing import Callable

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

    def fetch(self, pools: list[torch.Tensor], host_ids: list[int], device_ids: list[int],
              groups: list[list[int]] | None = None, after_group: Callable[[int], None] | None = None) -> None:
        """Copy host blocks into device pool blocks on the current stream, without waiting for the copies.

        `groups` (indices into `pools`; default one group of all) are copied in order, and `after_group(g)` is
        called once group g's copies are enqueued: a layer's blocks can be read as soon as its group has landed,
        while the next layer's are still on the way.
        """
        groups = [list(range(len(pools)))] if groups is None else groups
        src = torch.tensor(host_ids, dtype=torch.long)
        views = self._staging_views(len(host_ids))
        dst = self._device_ids(device_ids, pools[0].device)
        for g, members in enumerate(groups):
            for i in members:
                torch.index_select(self.tensors[i], 1, src, out=views[i])
                pools[i].index_copy_(1, dst, views[i].to(pools[i].device, non_blocking=self.pinned))
            if after_group is not None:
                after_group(g)
        self._record(pools[0].device)

    @staticmethod
    def _device_ids(ids: list[int], device: torch.device) -> torch.Tensor:
        """Block ids as an index tensor on `device`. On CUDA through pinned memory: a copy from pageable memory
        would block the host until the stream had run everything queued before it (the previous forward, which
        the copy stream waits for), and the fetch is meant to return while that still runs."""
        ids_cpu = torch.tensor(ids, dtype=torch.long)
        if device.type != "cuda":
            return ids_cpu
        return ids_cpu.pin_memory().to(device, non_blocking=True)

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
        # On the current stream: the compute stream for a spill, the copy stream for a fetch.
        if device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(device))

    def free(self) -> None:
        self.tensors = []
        self.capacity_blocks = 0
        self._staging = []
        self._staging_blocks = 0
