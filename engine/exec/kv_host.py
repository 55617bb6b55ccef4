"""Host memory for spilled KV blocks (`--kv-resident`): one tensor per device pool tensor, block-indexed like it.

Per pool tensor `[Hkv, blocks, block_tokens(, D)]` (keys, values, and for int8 their scales) a host tensor of the
same layout, pinned on CUDA so the copies are DMA transfers. It grows by doubling (a copy of what it holds) and
never shrinks: spilled memory is reused through the ledger's free host blocks.
"""

from __future__ import annotations

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
        for pool, host in zip(pools, self.tensors):
            host.index_copy_(1, dst, pool.index_select(1, src).to("cpu"))

    def fetch(self, pools: list[torch.Tensor], host_ids: list[int], device_ids: list[int]) -> None:
        """Copy host blocks into device pool blocks (stream-ordered before the forward that reads them)."""
        src = torch.tensor(host_ids, dtype=torch.long)
        dst = torch.tensor(device_ids, dtype=torch.long, device=pools[0].device)
        for pool, host in zip(pools, self.tensors):
            picked = host.index_select(1, src)
            if self.pinned:
                picked = picked.pin_memory()
            pool.index_copy_(1, dst, picked.to(pool.device, non_blocking=self.pinned))

    def free(self) -> None:
        self.tensors = []
        self.capacity_blocks = 0
