"""The --kv-resident ledger (engine.exec.kv.blocks): who holds which block, what a forward needs, what spills."""

from __future__ import annotations

import pytest

from engine.exec.kv.blocks import BlockLayout, BlockLedger, PoolTooSmall

# 3 slots; 10 logical blocks each (8 of context + 2 of scratch margin); 2 resident; 4-token blocks.
LAYOUT = BlockLayout(num_slots=3, blocks_per_slot=10, context_blocks=8, resident_blocks=2, block_tokens=4)


def test_resident_blocks_are_fixed_and_everything_else_starts_at_scratch():
    ledger = BlockLedger(LAYOUT, pool_blocks=6)
    assert ledger.table_row(1) == [2, 3] + [LAYOUT.scratch_block] * 8
    assert LAYOUT.scratch_block == 6 and LAYOUT.pool_base == 7 and LAYOUT.window_blocks == 6


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
