"""Host memory for spilled KV blocks: scattered blocks go out and come back bit for bit, and a run of consecutive
host ids is one transfer per pool tensor (the first version gathered every block with the CPU)."""

from __future__ import annotations

import pytest
import torch

from engine.exec.kv.host import HostKVStore, host_runs


def _pools(blocks: int = 12) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, blocks, 4, 8, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, blocks, 4, 8, generator=gen).to(torch.bfloat16)
    scales = torch.rand(2, blocks, 4, generator=gen)  # int8 pools carry per-(head, token) scales beside them
    return [k, v, scales]


def test_runs_of_consecutive_host_ids():
    assert host_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]
    assert host_runs([]) == []


def test_scattered_blocks_spill_and_fetch_back_bit_for_bit():
    pools = _pools()
    before = [p.clone() for p in pools]
    store = HostKVStore(pools, pinned=False)
    store.ensure(8)
    store.spill(pools, [9, 2, 5], [6, 0, 3])  # device blocks 9, 2, 5 -> host blocks 6, 0, 3
    for pool in pools:
        pool[:, [9, 2, 5]] = 0  # their device blocks are reused by another slot
    store.fetch(pools, [3, 6, 0], [1, 11, 7])  # back into other device blocks
    for pool, old in zip(pools, before):
        assert torch.equal(pool[:, [11, 7, 1]], old[:, [9, 2, 5]])


def test_consecutive_host_ids_in_any_order_are_one_transfer_per_pool_tensor():
    pools = _pools(20)
    before = [p.clone() for p in pools]
    store = HostKVStore(pools, pinned=False)
    store.ensure(16)
    store.spill(pools, [4, 17, 8, 1, 12], [10, 7, 9, 11, 8])  # host ids 7..11, handed out in any order
    assert store.transfers == len(pools)
    for pool in pools:
        pool.zero_()
    store.fetch(pools, [11, 7, 8, 10, 9], [0, 1, 2, 3, 4])
    assert store.transfers == 2 * len(pools)
    for pool, old in zip(pools, before):
        assert torch.equal(pool[:, [0, 1, 2, 3, 4]], old[:, [1, 17, 12, 4, 8]])


def test_what_the_host_holds_survives_growth(monkeypatch):
    from engine.exec.kv import host

    monkeypatch.setattr(host, "CHUNK_BLOCKS", 4)
    pools = _pools(40)
    reference = [p.clone() for p in pools]
    store = HostKVStore(pools, pinned=False)
    store.ensure(4)
    store.spill(pools, [0, 1], [0, 1])
    held = [t.data_ptr() for t in store.chunks[0]]
    store.ensure(40)  # nine more chunks of 4 blocks: the first is kept as it is, nothing copied
    assert store.capacity_blocks == 40 and [t.data_ptr() for t in store.chunks[0]] == held
    store.spill(pools, list(range(2, 40)), list(range(2, 40)))
    for pool in pools:
        pool.zero_()
    store.fetch(pools, list(range(40)), list(reversed(range(40))))
    for pool, old in zip(pools, reference):
        assert torch.equal(pool.flip(1), old)


def test_a_fetch_lands_one_group_after_another_in_the_order_given():
    """A fetch copies one group of pool tensors (a layer's keys, values and scales) after another and says when
    each is enqueued: on CUDA the layer's event is recorded there, so layer 0 is read while later layers copy."""
    pools = _pools()
    before = [p.clone() for p in pools]
    store = HostKVStore(pools, pinned=False)
    store.ensure(4)
    store.spill(pools, [9, 2], [1, 3])
    for pool in pools:
        pool[:, [4, 5]] = 0
    landed = []

    def after_group(group: int) -> None:
        landed.append((group, [torch.equal(p[:, [4, 5]], old[:, [9, 2]]) for p, old in zip(pools, before)]))

    store.fetch(pools, [1, 3], [4, 5], groups=[[2], [0, 1]], after_group=after_group)
    assert landed == [(0, [False, False, True]), (1, [True, True, True])]


def test_a_copy_larger_than_the_staging_bound_goes_in_slices_that_each_fit(monkeypatch):
    """VRAM is full by design: a forward that spills or fetches thousands of blocks at once (a burst of long
    prompts) stages a bounded slice at a time. With room for two blocks' staging, and an out-of-memory error for
    any staging buffer larger than that, 9 scattered blocks still go out and come back bit for bit."""
    from engine.exec.kv import host

    pools = _pools(24)
    before = [p.clone() for p in pools]
    block_bytes = max(p[:, :1].numel() * p.element_size() for p in pools)
    monkeypatch.setattr(host, "STAGE_BYTES", 2 * block_bytes)
    real, staged_blocks = host.device_scratch, []

    def device_scratch(shape, dtype, device):
        if shape[0] > 2:
            raise torch.OutOfMemoryError(f"a staging buffer of {shape[0]} blocks")
        staged_blocks.append(shape[0])
        return real(shape, dtype, device)

    monkeypatch.setattr(host, "device_scratch", device_scratch)
    store = HostKVStore(pools, pinned=False)
    store.ensure(16)
    out = [21, 3, 17, 9, 0, 12, 5, 23, 14]
    store.spill(pools, out, [8, 0, 6, 2, 15, 4, 11, 1, 7])
    for pool in pools:
        pool.zero_()
    store.fetch(pools, [15, 0, 2, 8, 1, 4, 6, 7, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9])
    for pool, old in zip(pools, before):
        assert torch.equal(pool[:, [1, 2, 3, 4, 5, 6, 7, 8, 9]], old[:, [0, 3, 9, 21, 23, 12, 17, 14, 5]])
    assert staged_blocks and max(staged_blocks) == 2 and sum(staged_blocks) == 2 * 9 * len(pools)


def test_host_memory_the_machine_does_not_have_is_a_clear_error_and_nothing_is_allocated(monkeypatch):
    """Spilled KV grows a chunk at a time only while the host keeps its floor available: past it the error names
    the MiB (a store that doubled one tensor held the old and the new copy at once, whatever the host had left)."""
    from engine.exec.kv import host

    pools = _pools()
    store = HostKVStore(pools, pinned=False)
    store.ensure(1)
    monkeypatch.setattr(host, "host_memory_mib", lambda: (16384.0, 1700.0))  # under the 2 GiB floor
    with pytest.raises(host.HostKVFull, match=r"leave the host 1700 MiB available, under the 2048 MiB it keeps"):
        store.ensure(host.CHUNK_BLOCKS + 1)
    assert store.capacity_blocks == host.CHUNK_BLOCKS
