"""A tier whose blocks live in the KV pool (engine.exec.kv.tier_pool): reuse maps the slot's table at the tier's
pool blocks (no copy), a computed prompt block becomes a tier block by handing its pool blocks over, mapped
blocks are never evicted or freed, and resizing reallocates the pool with the mapped KV intact."""

from __future__ import annotations

import pytest
import torch

from engine.core.prefix_index import PrefixIndex
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.exec.kv.tier_pool import SharedTierBlocks
from engine.exec.kv.tier import AdaptiveTier
from engine.telemetry import EventBus

TIER_TOKENS = 128  # two 64-token pool blocks per tier block
PROMPT = list(range(3, 3 + 256))  # two tier blocks


def _setup(storage: str = "bf16", preallocate: bool = False, budget_blocks: int = 8):
    kv = SlotKVCache(KVGeometry(2, 3, 2, 8, 512, 16), storage, torch.float32, "cpu")
    index = PrefixIndex(TIER_TOKENS, 0)
    shared = SharedTierBlocks(kv, TIER_TOKENS)
    resizes: list[int] = []
    shared.on_resize = lambda: resizes.append(shared.num_blocks)
    block_mib = kv.geometry.bytes_per_token(storage, torch.float32) * TIER_TOKENS / (1 << 20)
    tier = AdaptiveTier(index, kv, EventBus(), torch.device("cpu"), budget_blocks * block_mib + 1e-9, preallocate,
                        shared=shared)
    return tier, index, kv, shared, resizes


def _write_prompt(kv: SlotKVCache, slot: int, n: int, seed: int) -> None:
    """KV for positions [0, n) of `slot` in every layer, as a prefill would write it."""
    gen = torch.Generator().manual_seed(seed)
    kv.bind(torch.tensor([slot]), n)
    for layer in range(kv.geometry.num_layers):
        k, v = torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)
        kv.attend(layer, torch.randn(1, 4, n, 8, generator=gen), k, v, torch.arange(n).view(1, -1))


def _span(kv: SlotKVCache, slot: int, n: int) -> list[torch.Tensor]:
    return [t for layer in range(kv.geometry.num_layers) for t in kv.read(layer, torch.tensor([slot]), 0, n)]


def _no_copies(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a shared tier copied KV between a slot and the tier")

    monkeypatch.setattr(SlotKVCache, "read_span", refuse)
    monkeypatch.setattr(SlotKVCache, "write_span", refuse)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_reuse_points_the_slot_table_at_the_tier_blocks_and_copies_nothing(storage, monkeypatch):
    tier, index, kv, shared, _ = _setup(storage)
    _write_prompt(kv, 0, 256, seed=1)
    before = kv.block_table[0].tolist()
    _no_copies(monkeypatch)
    refs = index.insert(PROMPT)
    assert tier.fill(refs, 0) == []
    assert kv.block_table[0].tolist() == before  # the slot maps the very blocks it wrote
    assert [p for r in refs for p in shared.physical(r.block_id)] == before[:4]
    matched = index.match(PROMPT)
    tier.load(matched, 2)
    row = kv.block_table[2].tolist()
    assert row[:4] == before[:4] and row[4:] == shared.home[2][4:]
    for a, b in zip(_span(kv, 2, 256), _span(kv, 0, 256)):
        assert torch.equal(a, b)
    assert (tier.shared_blocks, tier.copied_in_blocks, tier.filled_blocks) == (2, 0, 2)
    assert tier.snapshot()["pool_blocks"] == 2 and tier.snapshot()["shared_blocks"] == 2


def test_a_finished_request_leaves_its_blocks_to_the_tier_and_its_slot_writes_fresh_blocks():
    tier, index, kv, shared, _ = _setup()
    _write_prompt(kv, 0, 256, seed=2)
    refs = index.insert(PROMPT)
    tier.fill(refs, 0)
    cached = _span(kv, 0, 256)
    tier.retire_slot(0)
    tier.reclaim_retired()
    row = kv.block_table[0].tolist()
    tier_blocks = {p for r in refs for p in shared.physical(r.block_id)}
    assert not tier_blocks & set(row)  # the slot got other blocks: the handed-over ones are the tier's now
    assert index.stats().pinned_blocks == 0
    _write_prompt(kv, 0, 256, seed=3)  # the next request in the slot overwrites its own blocks only
    tier.load(index.match(PROMPT), 1)
    for a, b in zip(_span(kv, 1, 256), cached):
        assert torch.equal(a, b)


def test_eviction_and_release_never_take_a_block_a_slot_maps():
    tier, index, kv, shared, _ = _setup()
    _write_prompt(kv, 0, 256, seed=4)
    refs = index.insert(PROMPT)
    tier.fill(refs, 0)
    tier.retire_slot(0)
    tier.load(index.match(PROMPT), 1)  # slot 1 maps both blocks
    tier.reclaim_retired()  # slot 0's mappings go (between steps)
    assert index.evict(10) == []
    assert tier.release(100 * tier.block_mib, "test") == 0.0  # slot 1's pins stay
    assert all(shared.is_backed(r.block_id) for r in refs)
    tier.retire_slot(1)
    assert tier.release(100 * tier.block_mib, "test") == 0.0  # retired, not yet reclaimed: still mapped
    tier.reclaim_retired()
    assert tier.release(100 * tier.block_mib, "test") == pytest.approx(2 * tier.block_mib)
    assert shared.backing == {} and kv.k[0].shape[1] == kv.geometry.num_blocks


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_a_shrinking_preallocated_tier_compacts_the_pool_and_keeps_what_slots_map(storage):
    tier, index, kv, shared, resizes = _setup(storage, preallocate=True, budget_blocks=6)
    homes = kv.geometry.num_blocks
    assert kv.k[0].shape[1] == homes + 12 and resizes == [homes + 12]
    assert kv.mib == pytest.approx(SlotKVCache(kv.geometry, storage, torch.float32, "cpu").mib)  # tier not in it
    _write_prompt(kv, 0, 256, seed=5)
    refs = index.insert(PROMPT)
    tier.fill(refs, 0)
    tier.load(index.match(PROMPT), 2)
    cached = _span(kv, 2, 256)
    freed = tier.release(100 * tier.block_mib, "graph capture")
    assert freed == pytest.approx(4 * tier.block_mib)  # the 4 free blocks; the 2 mapped ones stay
    assert kv.k[0].shape[1] == homes + 4 and resizes[-1] == homes + 4
    assert max(max(r) for r in kv.block_table.tolist()) < homes + 4
    for a, b in zip(_span(kv, 2, 256), cached):
        assert torch.equal(a, b)
    for a, b in zip(_span(kv, 0, 256), cached):
        assert torch.equal(a, b)
    tier.set_budget(5 * tier.block_mib + 1e-9, "room")  # regrowth takes own blocks: the pool stays
    assert kv.k[0].shape[1] == homes + 4 and tier.capacity_blocks == 5 and len(tier._blocks) == 3
    assert tier.mib == pytest.approx(5 * tier.block_mib)


def test_own_blocks_are_copied_pool_blocks_shared_and_releases_take_own_blocks_first(monkeypatch):
    kv = SlotKVCache(KVGeometry(2, 3, 2, 8, 512, 16), "bf16", torch.float32, "cpu")
    index = PrefixIndex(TIER_TOKENS, 0)
    shared = SharedTierBlocks(kv, TIER_TOKENS)
    resizes: list[int] = []
    shared.on_resize = lambda: resizes.append(shared.num_blocks)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * TIER_TOKENS / (1 << 20)
    tier = AdaptiveTier(index, kv, EventBus(), torch.device("cpu"), 5 * block_mib + 1e-9, True, shared=shared,
                        pooled_mib=2 * block_mib + 1e-9)
    assert len(shared.backing) == 2 and len(tier._blocks) == 3 and resizes == [kv.geometry.num_blocks + 4]
    prompt = list(range(3, 3 + 512))
    _write_prompt(kv, 0, 512, seed=7)
    refs = index.insert(prompt)  # the lowest ids first: the two pool blocks, then two own blocks
    assert tier.fill(refs, 0) == []
    tier.load(index.match(prompt), 1)
    assert (tier.shared_blocks, tier.copied_in_blocks) == (2, 2)
    assert kv.block_table[1].tolist()[:4] == kv.block_table[0].tolist()[:4]
    for a, b in zip(_span(kv, 1, 512), _span(kv, 0, 512)):
        assert torch.equal(a, b)
    tier.retire_slot(0)
    tier.retire_slot(1)
    tier.reclaim_retired()
    assert tier.release(2 * block_mib, "graph capture") == pytest.approx(2 * block_mib)
    assert len(tier._blocks) == 1 and len(shared.backing) == 2 and len(resizes) == 1  # the pool was not touched


def test_a_tier_capped_at_its_block_limit_still_keeps_its_own_blocks(monkeypatch):
    """A tiny model on a large card: the budget is more blocks than MAX_TIER_BLOCKS, and the cap must come out of
    the pool's share, not the own blocks' (taken from the own blocks, it leaves every block in the pool and none of
    the tier's own, so each out-of-memory release would reallocate the pool and drop every captured graph)."""
    import engine.exec.kv.tier as vram

    monkeypatch.setattr(vram, "MAX_TIER_BLOCKS", 6)
    kv = SlotKVCache(KVGeometry(2, 3, 2, 8, 512, 16), "bf16", torch.float32, "cpu")
    shared = SharedTierBlocks(kv, TIER_TOKENS)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * TIER_TOKENS / (1 << 20)
    tier = AdaptiveTier(PrefixIndex(TIER_TOKENS, 0), kv, EventBus(), torch.device("cpu"), 20 * block_mib + 1e-9,
                        True, shared=shared, pooled_mib=17 * block_mib + 1e-9)  # 3 blocks' worth of own
    assert tier.capacity_blocks == 6 and len(tier._blocks) == 3 and len(shared.backing) == 3


def test_growth_stops_where_the_measured_room_ends():
    kv = SlotKVCache(KVGeometry(2, 3, 2, 8, 512, 16), "bf16", torch.float32, "cpu")
    index = PrefixIndex(TIER_TOKENS, 0)
    shared = SharedTierBlocks(kv, TIER_TOKENS)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * TIER_TOKENS / (1 << 20)
    transient = shared.transient_mib(shared.num_blocks)
    tier = AdaptiveTier(index, kv, EventBus(), torch.device("cpu"), 40 * block_mib, True,
                        room_mib=lambda: 7.5 * block_mib + transient, shared=shared)
    assert tier.capacity_blocks == len(shared.backing) == 7 and len(index.free_block_ids()) == 7


def test_a_discarded_fill_is_not_handed_over_and_its_pins_are_left_alone():
    tier, index, kv, shared, _ = _setup()
    _write_prompt(kv, 0, 256, seed=6)
    refs = index.insert(PROMPT)
    index.discard([refs[1].block_id])  # the request failed in this step: the scheduler forgot the block
    assert tier.fill(refs, 0) == []
    assert shared.mapped[0].keys() == {0} and not shared.is_backed(refs[1].block_id)
    other = index.insert(list(range(900, 900 + TIER_TOKENS)))  # the freed id is reused at once
    index.pin([other[0].block_id])
    tier.retire_slot(0)
    tier.reclaim_retired()
    assert index.is_pinned(other[0].block_id)  # the discarded mapping did not take the new owner's pin


def _failing_allocations(monkeypatch, failures: int) -> list[int]:
    """Fault injection: the next `failures` pool-tensor allocations raise out-of-memory."""
    from engine.exec.kv import pool_resize as kv_pool_resize

    real, left = kv_pool_resize.empty, [failures]

    def empty(shape, dtype, device):
        if left[0] > 0:
            left[0] -= 1
            raise torch.OutOfMemoryError("injected: out of memory")
        return real(shape, dtype, device)

    monkeypatch.setattr(kv_pool_resize, "empty", empty)
    return left


def test_a_shrink_with_no_room_for_the_new_tensor_goes_through_host_memory(monkeypatch):
    tier, index, kv, shared, _ = _setup(preallocate=True, budget_blocks=6)
    _write_prompt(kv, 0, 256, seed=8)
    tier.fill(index.insert(PROMPT), 0)
    tier.load(index.match(PROMPT), 2)
    cached = _span(kv, 2, 256)
    left = _failing_allocations(monkeypatch, 1)
    assert tier.release(100 * tier.block_mib, "out of memory") == pytest.approx(4 * tier.block_mib)
    assert left == [0] and all(t.shape[1] == kv.geometry.num_blocks + 4 for t in kv.pools())
    for a, b in zip(_span(kv, 2, 256), cached):
        assert torch.equal(a, b)


def test_a_fill_whose_pool_growth_runs_out_of_memory_fails_its_blocks_and_changes_nothing(monkeypatch):
    tier, index, kv, shared, resizes = _setup()  # a host tier: blocks are backed as they are filled
    _write_prompt(kv, 0, 256, seed=9)
    row, pool = kv.block_table[0].tolist(), kv.k[0].shape[1]
    _failing_allocations(monkeypatch, 1)
    refs = index.insert(PROMPT)
    assert tier.fill(refs, 0) == [r.block_id for r in refs]  # the engine discards them from the index
    assert shared.backing == {} and shared.mapped[0] == {} and resizes == []
    assert kv.block_table[0].tolist() == row and all(t.shape[1] == pool for t in kv.pools())


def test_a_fill_whose_growth_fails_part_way_drops_the_graphs_that_read_the_tensors_it_put_back(monkeypatch):
    """The tensors that grew before the out-of-memory error are put back by new allocations: same sizes, new
    addresses, and a graph captured on the old ones would replay on freed memory (a device's illegal access)."""
    from engine.exec.kv import pool_resize as kv_pool_resize

    tier, index, kv, shared, resizes = _setup()
    _write_prompt(kv, 0, 256, seed=9)
    pool, addresses = kv.k[0].shape[1], [t.data_ptr() for t in kv.pools()]
    # a freed tensor's address stays taken, as on a device whose allocator gave its cache back when one failed
    held, real, seen = [t.untyped_storage() for t in kv.pools()], kv_pool_resize.empty, [0]

    def empty(shape, dtype, device):
        seen[0] += 1
        if seen[0] == 2:  # the second tensor of the growth
            raise torch.OutOfMemoryError("injected: out of memory")
        tensor = real(shape, dtype, device)
        held.append(tensor.untyped_storage())
        return tensor

    monkeypatch.setattr(kv_pool_resize, "empty", empty)
    refs = index.insert(PROMPT)
    assert tier.fill(refs, 0) == [r.block_id for r in refs]  # failed, as with nothing grown
    assert all(t.shape[1] == pool for t in kv.pools()) and [t.data_ptr() for t in kv.pools()] != addresses
    assert resizes == [pool]  # the graphs were dropped
