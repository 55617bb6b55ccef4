"""Host memory for spilled KV blocks (`--kv-resident`): one tensor per device pool tensor, block-major.

A device pool tensor is `[Hkv, blocks, block_tokens(, D)]` (keys, values, and for int8 their scales); its host
tensor is `[blocks, Hkv, block_tokens(, D)]`, pinned on CUDA, so that one host block is one contiguous range and
a run of consecutive host block ids is one DMA transfer. It grows by doubling (a copy of what it holds) and never
shrinks: spilled memory is reused through the ledger's free host blocks.

A copy's blocks are scattered on the device, so the device side goes through a block-major device buffer of
the copy's blocks (gathered or scattered with one indexing kernel per pool tensor); the host side is never
touched by the CPU. Moves are ordered by host id, so the number of transfers is the number of runs of
consecutive host ids (a slot's spilled blocks come back as the few runs they left in). The first version
gathered the host side with the CPU into pinned staging, which bound a step far below the PCIe rate
(docs/BENCHMARKS.md, `bench kvspill`).

A spill is synchronous for its caller (the device blocks it frees are reused at once). A fetch is enqueued on
whatever stream is current, one group of pool tensors (one layer's) after another, and returns without waiting:
on CUDA the caller (engine.exec.kv.paging) runs it on its copy stream and records a layer's event after each
group. Nothing on the host side is reused before its copy is done: pinned memory that a copy still reads is held
by torch's pinned-memory allocator until the copy's stream passes it.
"""

from __future__ import annotations

from typing import Callable

import torch

MIB = float(1 << 20)
_MIN_HOST_BLOCKS = 16


def host_runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first position in the sorted order, first host id, length) of each run of consecutive ids, ids sorted."""
    runs: list[tuple[int, int, int]] = []
    for pos, hid in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == hid:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((pos, hid, 1))
    return runs


class HostKVStore:
    """Host copies of pool blocks, addressed by host block id (engine.exec.kv.blocks.BlockLedger hands them out)."""

    def __init__(self, pools: list[torch.Tensor], pinned: bool) -> None:
        self._like = [(tuple(p.shape), p.dtype) for p in pools]
        self.pinned = pinned
        self.capacity_blocks = 0
        self.tensors: list[torch.Tensor] = []
        self.transfers = 0  # DMA transfers issued so far (one per run of consecutive host ids per pool tensor)

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
            t = torch.empty((cap, shape[0], *shape[2:]), dtype=dtype, pin_memory=self.pinned)
            if self.tensors:
                t[: self.capacity_blocks].copy_(self.tensors[i])
            grown.append(t)
        self.tensors = grown
        self.capacity_blocks = cap

    def spill(self, pools: list[torch.Tensor], device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device pool blocks into host blocks, on the current stream: the caller synchronizes before it
        reuses the device blocks."""
        runs, src = self._by_host_id(host_ids, device_ids, pools[0].device)
        for p in range(len(pools)):
            staged = pools[p].index_select(1, src).transpose(0, 1).contiguous()  # [n, Hkv, ...] block-major
            for pos, first, n in runs:
                self.tensors[p][first:first + n].copy_(staged[pos:pos + n], non_blocking=self.pinned)
            self.transfers += len(runs)

    def fetch(self, pools: list[torch.Tensor], host_ids: list[int], device_ids: list[int],
              groups: list[list[int]] | None = None, after_group: Callable[[int], None] | None = None) -> None:
        """Copy host blocks into device pool blocks on the current stream, without waiting for the copies.

        `groups` (indices into `pools`; default one group of all) are copied in order, and `after_group(g)` is
        called once group g's copies are enqueued: a layer's blocks can be read as soon as its group has landed,
        while the next layer's are still on the way.
        """
        groups = [list(range(len(pools)))] if groups is None else groups
        runs, dst = self._by_host_id(host_ids, device_ids, pools[0].device)
        for g, members in enumerate(groups):
            for p in members:
                host = self.tensors[p]
                staged = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype, device=pools[p].device)
                for pos, first, n in runs:
                    staged[pos:pos + n].copy_(host[first:first + n], non_blocking=self.pinned)
                pools[p].index_copy_(1, dst, staged.transpose(0, 1))
                self.transfers += len(runs)
            if after_group is not None:
                after_group(g)

    @staticmethod
    def _by_host_id(host_ids: list[int], device_ids: list[int], device: torch.device
                    ) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
        """The moves ordered by host id: their runs of consecutive host ids (`host_runs`), and their device block
        ids in that order as an index tensor on `device`. On CUDA through pinned memory: a copy from pageable
        memory would block the host until the stream had run everything queued before it (the previous forward,
        which the copy stream waits for), and the fetch is meant to return while that still runs."""
        order = sorted(range(len(host_ids)), key=host_ids.__getitem__)
        runs = host_runs([host_ids[i] for i in order])
        ids_cpu = torch.tensor([device_ids[i] for i in order], dtype=torch.long)
        if device.type != "cuda":
            return runs, ids_cpu
        return runs, ids_cpu.pin_memory().to(device, non_blocking=True)

    def free(self) -> None:
        self.tensors = []
        self.capacity_blocks = 0
