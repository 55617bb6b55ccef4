"""The adaptive tier and the VRAM budget: grow, release (one call, MiB actually freed), pins, fit checks."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.core.prefix_index import PrefixIndex
from engine.telemetry import EventBus
from engine.exec.kv.tier import AdaptiveTier, VramBudget, check_kv_fits


def _tier(preallocate: bool, budget_blocks: int = 10, storage: str = "bf16"):
    kv = SlotKVCache(KVGeometry(2, 2, 2, 8, 128, 16), storage, torch.float32, "cpu")
    index = PrefixIndex(16, 0)
    bus = EventBus()
    block_mib = kv.geometry.bytes_per_token(storage, torch.float32) * 16 / (1 << 20)
    tier = AdaptiveTier(index, kv, bus, torch.device("cpu"), budget_blocks * block_mib + 1e-9, preallocate)
    return tier, index, kv, bus


def _cache_prompt(index: PrefixIndex, tier: AdaptiveTier, tokens: list[int], slot: int = 0) -> list:
    refs = index.insert(tokens, 0)
    assert tier.fill(refs, slot) == []
    return refs


def test_preallocated_tier_takes_its_budget_up_front_and_release_returns_what_it_freed():
    tier, index, _, bus = _tier(preallocate=True, budget_blocks=10)
    assert tier.capacity_blocks == 10 and tier.mib == pytest.approx(10 * tier.block_mib)
    assert bus.history()[-1].action == "grow"
    _cache_prompt(index, tier, list(range(64)))  # 4 blocks used, 6 free
    freed = tier.release(7 * tier.block_mib, "graph capture")
    assert freed == pytest.approx(7 * tier.block_mib)
    assert tier.capacity_blocks == 3 and index.used_blocks == 3  # 6 free ids went first, then 1 LRU block
    ev = bus.history()[-1]
    assert (ev.action, ev.reason) == ("shrink", "graph capture") and ev.mib == pytest.approx(freed, abs=1e-3)


def test_release_never_takes_pinned_blocks():
    tier, index, _, _ = _tier(preallocate=True, budget_blocks=4)
    refs = _cache_prompt(index, tier, list(range(64)))
    index.pin(r.block_id for r in refs)
    assert tier.release(100 * tier.block_mib, "admission") == 0.0
    assert index.used_blocks == 4
    index.unpin(r.block_id for r in refs)
    assert tier.release(100 * tier.block_mib, "admission") == pytest.approx(4 * tier.block_mib)


def test_host_tier_allocates_on_fill_and_keeps_its_budget_after_release():
    tier, index, _, bus = _tier(preallocate=False, budget_blocks=10)
    assert tier.mib == 0 and tier.capacity_blocks == 10
    _cache_prompt(index, tier, list(range(48)))
    assert tier.mib == pytest.approx(3 * tier.block_mib)
    assert tier.release(tier.block_mib, "test") == pytest.approx(tier.block_mib)
    assert tier.capacity_blocks == 10 and index.used_blocks == 2


def test_set_budget_grows_and_shrinks_with_events():
    tier, _, _, bus = _tier(preallocate=True, budget_blocks=2)
    tier.set_budget(6 * tier.block_mib + 1e-9, "room")
    assert tier.capacity_blocks == 6 and bus.history()[-1].action == "grow"
    tier.set_budget(1 * tier.block_mib + 1e-9, "reserve")
    assert tier.capacity_blocks == 1 and bus.history()[-1].action == "shrink"


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_blocks_round_trip_between_slots_through_the_tier(storage):
    tier, index, kv, _ = _tier(preallocate=False, storage=storage)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 32, 8, generator=gen)
    kv.bind(torch.tensor([0]), 32)
    kv.attend(0, torch.randn(1, 4, 32, 8, generator=gen), k, k, torch.arange(32).view(1, -1))
    refs = _cache_prompt(index, tier, list(range(32)), slot=0)
    tier.load(refs, 1)
    assert torch.equal(kv.read_span(1, 0, 32)[0], kv.read_span(0, 0, 32)[0])


def test_kv_fit_check_names_needed_and_available_mib():
    with pytest.raises(ConfigError) as info:
        check_kv_fits(kv_mib=30000, weights_mib=9000, reserve_mib=1024, free_mib=20000, what="context", value=262144)
    msg = str(info.value)
    assert "30000 MiB" in msg and "18976 MiB" in msg and "1024 MiB reserve" in msg and info.value.param == "context"
    check_kv_fits(kv_mib=100, weights_mib=9000, reserve_mib=1024, free_mib=20000, what="context", value=8192)


def test_budget_breakdown_reports_each_part():
    tier, _, kv, _ = _tier(preallocate=True, budget_blocks=3)
    budget = VramBudget(torch.device("cpu"), reserve_mib=512, weights_mib=12.5, kv_mib=kv.mib, tier=tier)
    ev = budget.breakdown()
    assert ev.device == "cpu" and ev.weights_mib == 12.5 and ev.reserve_mib == 512
    assert ev.tier_mib == pytest.approx(tier.mib, abs=0.1) and ev.total_mib > 0 and ev.free_mib > 0
    budget.set_reserve(2048)
    assert budget.breakdown().reserve_mib == 2048


@pytest.mark.gpu
def test_gpu_tier_grows_into_free_vram_and_shrinks_for_the_reserve():
    kv = SlotKVCache(KVGeometry(4, 2, 8, 128, 4096, 64), "bf16", torch.bfloat16, "cuda")
    index = PrefixIndex(256, 0)
    tier = AdaptiveTier(index, kv, EventBus(), torch.device("cuda"), 256.0, preallocate=True)
    budget = VramBudget(torch.device("cuda"), reserve_mib=1024, weights_mib=0, kv_mib=kv.mib, tier=tier)
    budget.rebalance("test")
    assert budget.tier_room_mib() < 4 * tier.block_mib + 1
    before = tier.mib
    budget.set_reserve(int(budget.reserve_mib + 2048))
    assert tier.mib <= before - 2048 + tier.block_mib
    assert budget.tier_room_mib() >= -tier.block_mib


def test_growth_stops_where_the_measured_room_ends_not_where_block_bytes_say():
    # A device where each block really takes 12 % more than its bytes (allocator segments), with 20 blocks'
    # worth of bytes free above what must stay free: a budget of 40 blocks must stop at ~17, not take 20 or 40.
    kv = SlotKVCache(KVGeometry(2, 2, 2, 8, 128, 16), "bf16", torch.float32, "cpu")
    index, bus = PrefixIndex(16, 0), EventBus()
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * 16 / (1 << 20)
    holder: dict = {}

    def room_mib() -> float:
        tier = holder.get("tier")
        held = len(tier._blocks) if tier is not None else 0
        return 20 * block_mib - held * 1.12 * block_mib

    tier = AdaptiveTier(index, kv, bus, torch.device("cpu"), 0.0, True, room_mib=room_mib, room_check_mib=block_mib)
    holder["tier"] = tier
    tier.set_budget(40 * block_mib + 1e-9, "grow")
    assert tier.capacity_blocks == len(tier._blocks) == 17  # 17 * 1.12 = 19.04 <= 20; an 18th would exceed it
    assert room_mib() >= 0 and index.stats().capacity_blocks == 17
    assert bus.history()[-1].action == "grow" and bus.history()[-1].total_mib == pytest.approx(17 * block_mib, abs=1e-4)


def test_rebalance_does_not_grow_into_room_the_driver_does_not_have(monkeypatch):
    kv = SlotKVCache(KVGeometry(2, 2, 2, 8, 128, 16), "bf16", torch.float32, "cpu")
    index, bus = PrefixIndex(16, 0), EventBus()
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * 16 / (1 << 20)
    driver_room = {"mib": 0.5 * block_mib}
    tier = AdaptiveTier(index, kv, bus, torch.device("cpu"), 0.0, True, room_mib=lambda: driver_room["mib"])
    budget = VramBudget(torch.device("cuda"), reserve_mib=1.0, weights_mib=0, kv_mib=0, tier=tier)
    # The books (free + cached) say 100 blocks fit; the driver has half a block: no resize, no event.
    monkeypatch.setattr(VramBudget, "tier_room_mib", lambda self: 100 * block_mib)
    resizes = []
    monkeypatch.setattr(index, "resize", lambda n, _orig=index.resize: resizes.append(n) or _orig(n))
    budget.rebalance("tick")
    assert resizes == [] and tier.capacity_blocks == 0 and bus.history() == []
    driver_room["mib"] = 10 * block_mib + 1e-9
    budget.rebalance("tick")
    assert tier.capacity_blocks == 10 and bus.history()[-1].action == "grow"


def test_make_room_frees_tier_memory_and_keeps_it_as_headroom():
    tier, index, kv, _ = _tier(preallocate=True, budget_blocks=8)
    budget = VramBudget(torch.device("cpu"), reserve_mib=1.0, weights_mib=0, kv_mib=kv.mib, tier=tier)
    freed = budget.make_room(3 * tier.block_mib, "prefill step out of memory")
    assert freed == pytest.approx(3 * tier.block_mib) and tier.capacity_blocks == 5
    assert budget.headroom_mib == pytest.approx(freed)
    budget.make_room(1000 * tier.block_mib, "again")
    assert budget.headroom_mib <= 4 * 256.0  # bounded: one bad step cannot starve the tier for good


def test_a_kv_pool_short_of_blocks_takes_the_tiers_pool_blocks_and_reallocates_nothing():
    """KV by use on a GPU: the tier starts by backing its ids with every free pool block (and keeps own blocks
    beside them). The first prompt past the free blocks asked the tier for memory, which gave own blocks first;
    the pool then grew into that memory: every pool tensor copied and every captured graph dropped, at the first
    request of a fresh engine (the engine's own timeline on an H100: all 8 decode graphs CAPTURE_ALL had captured)."""
    from engine.exec.kv.tier_ledger import LedgerTierBlocks

    geometry = KVGeometry(2, 4, 2, 8, 256, 16)
    resized = []
    kv = SlotKVCache(geometry, "bf16", torch.float32, "cpu", 0, geometry.layout(0).window_blocks,
                     on_resize=lambda: resized.append("pool reallocated"))
    paging = kv.paging
    shared = LedgerTierBlocks(kv, 256)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * 256 / (1 << 20)
    tier = AdaptiveTier(PrefixIndex(256, 0), kv, EventBus(), torch.device("cpu"), 12 * block_mib + 1e-9,
                        preallocate=True, shared=shared, pooled_mib=8 * block_mib + 1e-9)
    paging.take_memory = lambda mib, reason: tier.release(mib, reason, pool_first=True)  # engine_setup's wiring
    assert len(shared.backing) == 8 and paging.ledger.free_pool_blocks == 0 and len(tier._blocks) == 4
    pools = [p.data_ptr() for p in kv.pools()]
    resized.clear()

    kv.prepare({0: 200, 1: 200})  # 8 pool blocks the pool does not have free

    assert resized == [] and [p.data_ptr() for p in kv.pools()] == pools
    assert paging.ledger.missing_blocks({0: 200, 1: 200}) == 0 and paging.ledger.host_held_blocks == 0
    # 8 pool blocks and a spare one per slot: three tier blocks (12 pool blocks) went, own kept
    assert len(shared.backing) == 5 and len(tier._blocks) == 4


def test_a_step_that_took_the_tiers_pool_blocks_leaves_each_slot_its_next_block_free():
    """Decoding rows cross a block at nearly every step of a large batch. A step that needs the tier's blocks is
    never launched ahead of the step in flight (decode_ahead: `maps_only`), so a step that asks the tier takes one
    spare block per slot of its forward: the slots' next crossings only map free blocks."""
    from engine.exec.kv.tier_ledger import LedgerTierBlocks

    geometry = KVGeometry(2, 4, 2, 8, 1024, 16)
    kv = SlotKVCache(geometry, "bf16", torch.float32, "cpu", 0, geometry.layout(0).window_blocks)
    paging = kv.paging
    shared = LedgerTierBlocks(kv, 256)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * 256 / (1 << 20)
    tier = AdaptiveTier(PrefixIndex(256, 0), kv, EventBus(), torch.device("cpu"), 12 * block_mib + 1e-9,
                        preallocate=True, shared=shared, pooled_mib=16 * block_mib + 1e-9)
    paging.take_memory = lambda mib, reason: tier.release(mib, reason, pool_first=True)
    assert paging.ledger.free_pool_blocks == 0  # the tier backs every pool block
    wants = {0: 256, 1: 256}
    paging.prepare(wants)  # each slot's first four blocks, from the tier
    assert paging.ledger.missing_blocks(wants) == 0
    assert paging.maps_only({0: 257, 1: 257}), paging.ledger.free_pool_blocks  # the fifth: free already


def test_memory_asked_for_anything_but_the_pool_still_comes_from_own_blocks_first():
    """A graph capture or the reserve needs device memory: the tier's blocks in the pool would free none."""
    from engine.exec.kv.tier_ledger import LedgerTierBlocks

    geometry = KVGeometry(2, 4, 2, 8, 256, 16)
    kv = SlotKVCache(geometry, "bf16", torch.float32, "cpu", 0, geometry.layout(0).window_blocks)
    shared = LedgerTierBlocks(kv, 256)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * 256 / (1 << 20)
    tier = AdaptiveTier(PrefixIndex(256, 0), kv, EventBus(), torch.device("cpu"), 12 * block_mib + 1e-9,
                        preallocate=True, shared=shared, pooled_mib=8 * block_mib + 1e-9)
    tier.release(2 * block_mib, "graph decode out of memory")
    assert len(shared.backing) == 8 and len(tier._blocks) == 2


def _lending_pool(slots: int, tier_ids: int):
    """KV by use as on a GPU: the pool at one slot's window (16 blocks of 64 tokens), every block of it backing the
    preallocated tier's `tier_ids` ids of 256 tokens, wired as engine_setup wires them."""
    from engine.exec.kv.tier_ledger import LedgerTierBlocks

    geometry = KVGeometry(2, slots, 2, 8, 1024, 16)
    kv = SlotKVCache(geometry, "bf16", torch.float32, "cpu", 0, geometry.layout(0).window_blocks)
    block_mib = kv.geometry.bytes_per_token("bf16", torch.float32) * 256 / (1 << 20)
    tier = AdaptiveTier(PrefixIndex(256, 0), kv, EventBus(), torch.device("cpu"), tier_ids * block_mib + 1e-9,
                        preallocate=True, shared=LedgerTierBlocks(kv, 256), pooled_mib=tier_ids * block_mib + 1e-9)
    kv.paging.take_memory = lambda mib, reason: tier.release(mib, reason, pool_first=True)
    kv.paging.take_lent = tier.take_lent
    return kv, tier


def _prefill_and_lend(kv: SlotKVCache, tier: AdaptiveTier, slot: int, tokens: list[int]) -> torch.Tensor:
    """A prompt's KV written into the slot, its full tier blocks handed over to the tier (the slot maps them)."""
    data = torch.randn(2, 2, 2, len(tokens), 8)
    kv.write_span(slot, 0, data, None)
    assert tier.fill(tier.index.insert(tokens), slot) == []
    return data


def test_a_forward_takes_back_the_blocks_a_running_request_lent_the_tier_instead_of_failing():
    """On a GPU the tier backs its ids with the by-use pool's blocks, and a prompt's computed blocks are lent to
    it (the slot keeps mapping them). With the pool lent out to running requests, the next forward found nothing
    free or spillable: `PoolTooSmall` ended a request (a CPU replay of a burst of 64 mixed prompts on a tier of
    8 MiB). Now the tier gives up the cached blocks that only one other slot maps; that slot's KV goes to the
    host, bit for bit, and comes back when it runs again."""
    kv, tier = _lending_pool(slots=2, tier_ids=4)
    lent = _prefill_and_lend(kv, tier, 0, list(range(512)))
    assert len(tier.shared.mapped[0]) == 1  # its first 256 tokens (the tier kept room for one id)

    kv.prepare({1: 1024})  # the whole pool for slot 1: slot 0's lent blocks too

    assert kv.paging.ledger.missing_blocks({1: 1024}) == 0
    assert tier.index.match(list(range(512))) == []  # the cached prefix was given up, not a request
    back, _ = kv.read_span(0, 0, 512)  # slot 0 runs again: its KV from the host
    assert torch.equal(back, lent)


def test_a_decode_forward_is_split_when_a_fill_pins_tier_blocks_in_the_pool():
    """The decode rows of several slots fit the pool's block count together, but not beside a tier block this
    step's cache fill has pinned (it cannot be given to the pool): the forward is split instead of failing."""
    kv, tier = _lending_pool(slots=2, tier_ids=4)
    pinned = tier.index.insert(list(range(256)))  # a fill planned this step: the id is pinned until it lands
    tier.index.pin(ref.block_id for ref in pinned)
    assert len(tier.shared.backing) == 4

    groups = kv.paging.split_groups([[0, 1]], [512, 512])

    assert groups == [[0], [1]]
    for group in groups:
        kv.prepare({slot: 512 for slot in group})
