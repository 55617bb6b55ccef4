"""Host memory for spilled KV blocks (`--kv-resident`): one tensor per device pool tensor, block-major.

A device pool tensor is `[Hkv, blocks, block_tokens(, D)]` (keys, values, and for int8 their scales); its host
tensors are chunks of `[CHUNK_BLOCKS, Hkv, block_tokens(, D)]`, pinned on CUDA, so that one host block is one
contiguous range and a run of consecutive host block ids inside a chunk is one DMA transfer. It grows a chunk at a
time (nothing held is copied), only while the host keeps a floor of its memory available (`HostKVFull` names the
numbers otherwise), and never shrinks: spilled memory is reused through the ledger's free host blocks.

A copy's blocks are scattered on the device, so the device side goes through a block-major device buffer of the
copy's blocks (gathered or scattered with one indexing kernel per pool tensor), a bounded slice of the copy at a
time (`STAGE_BYTES`: VRAM is full by design); the host side is never touched by the CPU. Moves are ordered by host
id, so the number of transfers is the number of runs of consecutive host ids (a slot's spilled blocks come back as
the few runs they left in). The first version gathered the host side with the CPU into pinned staging, which bound
a step far below the PCIe rate (docs/BENCHMARKS.md, `bench kvspill`).

A spill is synchronous for its caller (the device blocks it frees are reused at once). A fetch is enqueued on
whatever stream is current, one group of pool tensors (one layer's) after another, and returns without waiting:
on CUDA the caller (engine.exec.kv.paging) runs it on its copy stream and records a layer's event after each
group. Nothing on the host side is reused before its copy is done: pinned memory that a copy still reads is held
by torch's pinned-memory allocator until the copy's stream passes it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from engine.exec.kv.vram_budget import device_memory_mib

MIB = float(1 << 20)
CHUNK_BLOCKS = 256  # host blocks per pinned allocation of each pool tensor: the unit the store grows by
HOST_FLOOR_MIB = 2048.0  # host memory spilled KV always leaves available, at least
HOST_FLOOR_SHARE = 0.1  # ... and at least this share of the host's memory
STAGE_BYTES = 64 << 20  # device memory a spill or fetch stages for one pool tensor at a time (a slice of its moves)


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


class HostKVFull(RuntimeError):
    """Spilled KV would take host memory the machine does not have (what is left must stay available)."""


class HostKVStore:
    """Host copies of pool blocks, addressed by host block id (engine.exec.kv.blocks.BlockLedger hands them out).

    Held in chunks of CHUNK_BLOCKS blocks per pool tensor: growing adds chunks and never copies what is held (one
    tensor doubled holds the old and the new copy at once), and each chunk is added only while the host keeps its
    floor available (HOST_FLOOR_MIB, HOST_FLOOR_SHARE): spilled KV must not take the memory the process runs in."""

    def __init__(self, pools: list[torch.Tensor], pinned: bool) -> None:
        self._like = [(tuple(p.shape), p.dtype) for p in pools]
        self.pinned = pinned
        self.chunks: list[list[torch.Tensor]] = []  # chunk -> one tensor per pool tensor, [CHUNK_BLOCKS, Hkv, ...]
        self.transfers = 0  # DMA transfers issued so far (one per run of consecutive host ids per pool tensor)

    @property
    def capacity_blocks(self) -> int:
        return len(self.chunks) * CHUNK_BLOCKS

    @property
    def mib(self) -> float:
        """Host memory allocated (held and free blocks)."""
        return sum(t.numel() * t.element_size() for chunk in self.chunks for t in chunk) / MIB

    def reachable_blocks(self) -> int:
        """Host blocks the store holds or can still add before the host reaches its floor."""
        total_mib, available_mib = host_memory_mib()
        if total_mib <= 0:
            return 1 << 40  # a host without /proc/meminfo: nothing to bound it by (ensure does not either)
        spare_mib = available_mib - host_floor_mib(total_mib)
        return self.capacity_blocks + max(0, int(spare_mib // self._chunk_mib())) * CHUNK_BLOCKS

    def ensure(self, blocks: int) -> None:
        """Room for host block ids [0, blocks); HostKVFull when the host cannot give it."""
        while self.capacity_blocks < blocks:
            chunk_mib = self._chunk_mib()
            total_mib, available_mib = host_memory_mib()
            floor_mib = host_floor_mib(total_mib)
            if total_mib > 0 and available_mib - chunk_mib < floor_mib:  # 0: a host without /proc/meminfo
                raise HostKVFull(
                    f"KV spilled to host memory would leave the host {available_mib - chunk_mib:.0f} MiB available, "
                    f"under the {floor_mib:.0f} MiB it keeps ({self.mib:.0f} MiB of KV held there, "
                    f"{blocks - self.capacity_blocks} more blocks asked for): fewer concurrent requests "
                    f"(--batch) or a shorter --context")
            self.chunks.append([torch.empty((CHUNK_BLOCKS, shape[0], *shape[2:]), dtype=dtype, pin_memory=self.pinned)
                                for shape, dtype in self._like])

    def spill(self, pools: list[torch.Tensor], device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device pool blocks into host blocks, on the current stream: the caller synchronizes before it
        reuses the device blocks."""
        for first, last, runs, src in self._slices(pools, host_ids, device_ids):
            for p in range(len(pools)):
                staged = device_scratch((last - first, *self._block_shape(p)), pools[p].dtype, pools[p].device)
                staged.copy_(pools[p].index_select(1, src).transpose(0, 1))  # [n, Hkv, ...] block-major
                for pos, chunk, at, n in runs:
                    self.chunks[chunk][p][at:at + n].copy_(staged[pos:pos + n], non_blocking=self.pinned)
                self.transfers += len(runs)

    def fetch(self, pools: list[torch.Tensor], host_ids: list[int], device_ids: list[int],
              groups: list[list[int]] | None = None, after_group: Callable[[int], None] | None = None) -> None:
        """Copy host blocks into device pool blocks on the current stream, without waiting for the copies.

        `groups` (indices into `pools`; default one group of all) are copied in order, and `after_group(g)` is
        called once group g's copies are enqueued: a layer's blocks can be read as soon as its group has landed,
        while the next layer's are still on the way.
        """
        groups = [list(range(len(pools)))] if groups is None else groups
        slices = list(self._slices(pools, host_ids, device_ids))
        for g, members in enumerate(groups):
            for p in members:
                for first, last, runs, dst in slices:
                    staged = device_scratch((last - first, *self._block_shape(p)), pools[p].dtype, pools[p].device)
                    for pos, chunk, at, n in runs:
                        staged[pos:pos + n].copy_(self.chunks[chunk][p][at:at + n], non_blocking=self.pinned)
                    pools[p].index_copy_(1, dst, staged.transpose(0, 1))
                    self.transfers += len(runs)
            if after_group is not None:
                after_group(g)

    def _slices(self, pools: list[torch.Tensor], host_ids: list[int], device_ids: list[int]
                ) -> Iterator[tuple[int, int, list[tuple[int, int, int]], torch.Tensor]]:
        """The moves ordered by host id, in slices whose staging fits STAGE_BYTES for the largest pool tensor:
        (first, end) positions in that order, the slice's runs of consecutive host ids split where a host chunk
        ends (`chunk_runs`, positions relative to the slice's first) and its device block ids as an index tensor.
        VRAM is full by design: a forward that moves thousands of blocks at once (a burst of long prompts) must
        not stage them all at once, or the step runs out of memory and every request in it ends."""
        block_bytes = max(p[:, :1].numel() * p.element_size() for p in pools)
        step = max(1, STAGE_BYTES // block_bytes)
        order = sorted(range(len(host_ids)), key=host_ids.__getitem__)
        for first in range(0, len(order), step):
            part = order[first:first + step]
            runs = chunk_runs(host_runs([host_ids[i] for i in part]))
            yield first, first + len(part), runs, self._index([device_ids[i] for i in part], pools[0].device)

    @staticmethod
    def _index(device_ids: list[int], device: torch.device) -> torch.Tensor:
        """Device block ids as an index tensor on `device`. On CUDA through pinned memory: a copy from pageable
        memory would block the host until the stream had run everything queued before it (the previous forward,
        which the copy stream waits for), and the fetch is meant to return while that still runs."""
        ids_cpu = torch.tensor(device_ids, dtype=torch.long)
        if device.type != "cuda":
            return ids_cpu
        return ids_cpu.pin_memory().to(device, non_blocking=True)

    def _chunk_mib(self) -> float:
        """Host memory one chunk takes across every pool tensor."""
        return sum(dtype.itemsize * math.prod(shape) // shape[1] for shape, dtype in self._like) * CHUNK_BLOCKS / MIB

    def _block_shape(self, p: int) -> tuple[int, ...]:
        """One host block of pool tensor p: [Hkv, block_tokens(, D)]."""
        shape = self._like[p][0]
        return (shape[0], *shape[2:])

    def free(self) -> None:
        self.chunks = []


def chunk_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """`host_runs`' runs split where a host chunk ends: (position, chunk, block in the chunk, length)."""
    out = []
    for pos, first, n in runs:
        while n > 0:
            chunk, at = divmod(first, CHUNK_BLOCKS)
            take = min(n, CHUNK_BLOCKS - at)
            out.append((pos, chunk, at, take))
            pos, first, n = pos + take, first + take, n - take
    return out


def host_memory_mib() -> tuple[float, float]:
    """(MemTotal, MemAvailable) of the host, MiB (a seam the tests shrink)."""
    return device_memory_mib(torch.device("cpu"))


def host_floor_mib(total_mib: float) -> float:
    """Host memory spilled KV always leaves available: HOST_FLOOR_MIB, or HOST_FLOOR_SHARE of it if more."""
    return max(HOST_FLOOR_MIB, HOST_FLOOR_SHARE * total_mib)


def device_scratch(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The staging buffer of one slice of a spill or fetch (a seam the tests inject out-of-memory errors into)."""
    return torch.empty(shape, dtype=dtype, device=device)
