"""The --kv-resident ledger (engine.exec.kv.blocks): who holds which block, what a forward needs, what spills."""

from __future__ import annotations

import pytest

from engine.exec.kv.blocks import BlockLayout, BlockLedger, PoolTooSmall

# 3 slots; 10 logical blocks each (8 of context + 2 of scratch margin); 2 resident; 4-token blocks.
LAYOUT = BlockLayout(num_slots=3, blocks_per_slot=10, context_blocks=8, resident_blocks=2, block_tokens=4)


def test_resident_blocks_are_fixed_and_everything_else_starts_at_scratch():
    ledger = BlockLedger(LAYOUT, pool_blocks=6)
    assert ledger.table_row(1) == [2, 3] + [LAYOUT.scratch_block] * 6 + [LAYOUT.sink_block] * 2  # the margin: the sink
    assert LAYOUT.scratch_block == 6 and LAYOUT.sink_block == 7 and LAYOUT.pool_base == 8 and LAYOUT.window_blocks == 6


def test_blocks_past_the_window_are_handed_out_on_demand_and_given_back():
    ledger = BlockLedger(LAYOUT, pool_blocks=6)
    plan = ledger.plan({0: 17})  # positions 0..16: blocks 0..4, of which 2..4 come from the pool
    assert not plan.spills and not plan.fetches and plan.changed_slots == {0}
    row = ledger.table_row(0)
    assert row[:2] == [0, 1] and all(b >= LAYOUT.pool_base for b in row[2:5]) and row[5] == LAYOUT.scratch_block
    assert ledger.free_pool_blocks == 3
    assert ledger.placement_tokens(0, 17) == (8, 9, 0)
    ledger.retire(0)
    assert ledger.free_pool_blocks == 3  # still valid until the next reclaim
    assert ledger.reclaim() == {0}
    assert ledger.free_pool_blocks == 6 and ledger.table_row(0)[2] == LAYOUT.scratch_block


def test_a_short_pool_spills_the_least_recently_used_other_slot_and_fetches_back():
    ledger = BlockLedger(LAYOUT, pool_blocks=6)
    ledger.plan({0: 32})  # 6 pool blocks: the whole pool
    ledger.plan({1: 16})  # 2 pool blocks: slot 0's two lowest spill
    assert ledger.placement_tokens(0, 32) == (8, 16, 8)
    assert ledger.table_row(0)[2:4] == [LAYOUT.scratch_block] * 2  # host blocks are never read in place
    plan = ledger.plan({0: 32})  # slot 0 again: its host blocks come back, slot 1's pool blocks spill
    assert [(m.slot, m.logical) for m in plan.fetches] == [(0, 2), (0, 3)]
    assert [(m.slot, m.logical) for m in plan.spills] == [(1, 2), (1, 3)]
    assert ledger.placement_tokens(0, 32) == (8, 24, 0) and ledger.host_held_blocks == 2


def test_a_forward_never_spills_its_own_slots_and_says_so_when_it_cannot_fit():
    ledger = BlockLedger(LAYOUT, pool_blocks=6)
    with pytest.raises(PoolTooSmall, match="6 are free and 0 can be spilled"):
        ledger.plan({0: 32, 1: 16})  # 6 + 2 pool blocks in one forward


# --- KV by use: no resident window, the tier's blocks in the same pool, held slots ---------------------------

BY_USE = BlockLayout(num_slots=2, blocks_per_slot=6, context_blocks=5, resident_blocks=0, block_tokens=4)


def test_a_borrowed_prefix_is_mapped_never_spilled_nor_freed_and_a_lent_block_becomes_the_tiers():
    ledger = BlockLedger(BY_USE, pool_blocks=6)
    tier = ledger.take_blocks(2)  # the tier backs a block of 2 pool blocks
    assert ledger.free_pool_blocks == 4
    ledger.borrow(0, {0: tier[0], 1: tier[1]})
    assert ledger.table_row(0)[:2] == tier and ledger.maps_only({0: 12})
    ledger.plan({0: 12})  # positions 8..11: one block of its own, the borrowed ones not mapped again
    assert ledger.used_blocks(0) == 1 and ledger.free_pool_blocks == 3 and ledger.borrowed_blocks == 2
    ledger.plan({1: 16})  # slot 1 needs 4 blocks: 3 free, then slot 0's own block is spilled, never the borrowed
    assert ledger.table_row(0)[:2] == tier and ledger.host_held_blocks == 1
    lent = ledger.lend(1, [0, 1])  # slot 1's computed blocks become the tier's: it keeps mapping them
    assert sorted(lent) == [0, 1] and ledger.used_blocks(1) == 2 and ledger.table_row(1)[:2] == [lent[0], lent[1]]
    ledger.give_blocks(tier)  # the tier dropped its old block: free again (no slot 0 reads it after release)
    ledger.retire(0)
    ledger.retire(1)
    ledger.reclaim()
    assert ledger.free_pool_blocks == 6 - 2 and ledger.borrowed_blocks == 0  # the lent blocks stay the tier's


def test_a_held_slot_is_never_spilled_and_needs_held_says_when_a_forward_cannot_fit_without_it():
    ledger = BlockLedger(BY_USE, pool_blocks=6)
    ledger.plan({0: 20})  # slot 0 (a chunk in flight) holds 5 blocks
    ledger.hold(0)
    assert ledger.needs_held({1: 12}) and not ledger.maps_only({1: 12})
    with pytest.raises(PoolTooSmall):
        ledger.plan({1: 12})
    ledger.unhold(0)
    assert not ledger.needs_held({1: 12})
    assert len(ledger.plan({1: 12}).spills) == 2
