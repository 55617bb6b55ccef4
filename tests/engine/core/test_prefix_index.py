"""The prefix index: hash chain, longest-prefix match, LRU eviction with pinning, insert, resize, stats."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.core.prefix_index import PrefixIndex, block_digests

ROOT = Path(__file__).resolve().parents[3]
BT = 4  # block_tokens: small so prompts stay readable


def _chain(seed: int, blocks: int) -> list[int]:
    """A prompt of `blocks` full blocks whose first token differs per seed."""
    return [seed * 1000 + i for i in range(blocks * BT)]


def test_digests_cover_full_blocks_only_and_chain_the_prefix() -> None:
    assert block_digests(list(range(11)), BT) == block_digests(list(range(8)), BT)
    assert len(block_digests(list(range(11)), BT)) == 2
    assert block_digests(list(range(3)), BT) == []
    # The same block content after a different first block has a different key: keys name whole prefixes.
    a = block_digests([1, 1, 1, 1, 5, 6, 7, 8], BT)
    b = block_digests([2, 2, 2, 2, 5, 6, 7, 8], BT)
    assert a[1] != b[1]
    assert block_digests([5, 6, 7, 8], BT)[0] != a[1]


def test_digests_do_not_depend_on_the_process_hash_seed() -> None:
    code = "from engine.core.prefix_index import block_digests; print(block_digests(list(range(8)), 4)[1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {block_digests(list(range(8)), BT)[1].hex()}


def test_match_returns_the_longest_cached_prefix() -> None:
    index = PrefixIndex(BT, capacity_blocks=16)
    prompt = _chain(1, 3)
    filled = index.insert(prompt)
    assert [ref.index for ref in filled] == [0, 1, 2]
    assert len({ref.block_id for ref in filled}) == 3
    assert index.match(prompt) == filled
    assert index.match(prompt + [7, 7]) == filled  # a trailing partial block is never matched
    # Diverging inside block 1: only block 0 matches.
    other = prompt[:BT] + [99] + prompt[BT + 1:]
    assert [ref.index for ref in index.match(other)] == [0]
    assert index.match(_chain(2, 3)) == []


def test_insert_returns_only_blocks_not_cached_yet() -> None:
    index = PrefixIndex(BT, capacity_blocks=16)
    index.insert(_chain(1, 2))
    longer = _chain(1, 4)
    new = index.insert(longer, first_new_block=2)
    assert [ref.index for ref in new] == [2, 3]
    assert index.insert(longer) == []  # everything already there
    assert index.stats().inserted_blocks == 4


def test_insert_needs_the_chain_head_to_be_cached() -> None:
    index = PrefixIndex(BT, capacity_blocks=16)
    assert index.insert(_chain(1, 3), first_new_block=1) == []
    assert index.used_blocks == 0
    with pytest.raises(ValueError, match="first_new_block=-1"):
        index.insert(_chain(1, 3), first_new_block=-1)


def test_lru_eviction_order_follows_use() -> None:
    index = PrefixIndex(BT, capacity_blocks=8)
    ids = {seed: index.insert(_chain(seed, 1))[0].block_id for seed in (1, 2, 3)}
    index.match(_chain(1, 1))  # 1 is now the most recent: 2 is the oldest
    assert index.evict(1) == [ids[2]]  # the least recently used first
    assert index.match(_chain(2, 1)) == []
    assert index.evict(5) == [ids[3], ids[1]]
    assert index.used_blocks == 0 and len(index.free_block_ids()) == 8
    assert index.stats().evicted_blocks == 3


def test_eviction_takes_a_chain_tail_before_its_head() -> None:
    index = PrefixIndex(BT, capacity_blocks=8)
    refs = index.insert(_chain(1, 3))
    index.match(_chain(1, 3))
    assert index.evict(1) == [refs[2].block_id]
    assert [ref.index for ref in index.match(_chain(1, 3))] == [0, 1]


def test_pinned_blocks_are_never_evicted_and_pins_nest() -> None:
    index = PrefixIndex(BT, capacity_blocks=8)
    a = index.insert(_chain(1, 1))[0].block_id
    b = index.insert(_chain(2, 1))[0].block_id
    index.pin([a])
    index.pin([a])
    assert index.evict(2) == [b]
    index.unpin([a])
    assert index.is_pinned(a) and index.evict(1) == []
    index.unpin([a])
    assert not index.is_pinned(a) and index.evict(1) == [a]
    with pytest.raises(KeyError, match=f"block_id={a}"):
        index.pin([a])


def test_a_full_index_evicts_lru_to_insert() -> None:
    index = PrefixIndex(BT, capacity_blocks=2)
    old = index.insert(_chain(1, 1))[0].block_id
    keep = index.insert(_chain(2, 1))[0].block_id
    index.match(_chain(2, 1))
    new = index.insert(_chain(3, 1))
    assert [ref.block_id for ref in new] == [old]
    assert index.match(_chain(1, 1)) == [] and index.match(_chain(2, 1))[0].block_id == keep


def test_insert_stops_when_only_pinned_or_own_blocks_remain() -> None:
    index = PrefixIndex(BT, capacity_blocks=3)
    pinned = index.insert(_chain(9, 1))[0].block_id
    index.pin([pinned])
    # Four blocks wanted, two places: the chain keeps its head instead of evicting it for its own tail.
    new = index.insert(_chain(1, 4))
    assert [ref.index for ref in new] == [0, 1]
    assert [ref.index for ref in index.match(_chain(1, 4))] == [0, 1]
    assert index.match(_chain(9, 1))[0].block_id == pinned


def test_discard_returns_unfilled_blocks_to_the_pool() -> None:
    index = PrefixIndex(BT, capacity_blocks=4)
    refs = index.insert(_chain(1, 2))
    index.discard([ref.block_id for ref in refs[1:]])
    assert [ref.index for ref in index.match(_chain(1, 2))] == [0]
    assert len(index.free_block_ids()) == 3


def test_resize_shrink_gives_back_free_ids_first_then_lru_blocks() -> None:
    index = PrefixIndex(BT, capacity_blocks=6)
    a = index.insert(_chain(1, 1))[0].block_id  # ids are handed out lowest first: 0, 1, 2
    b = index.insert(_chain(2, 1))[0].block_id
    c = index.insert(_chain(3, 1))[0].block_id
    assert (a, b, c) == (0, 1, 2)
    result = index.resize(4)
    assert result.released_block_ids == [4, 5] and result.evicted_block_ids == []
    result = index.resize(1)
    assert result.capacity_blocks == 1
    assert sorted(result.released_block_ids) == [a, b, 3]
    assert result.evicted_block_ids == [a, b]  # LRU order
    assert index.capacity_blocks == 1 and index.used_blocks == 1
    assert index.match(_chain(3, 1))[0].block_id == c


def test_resize_cannot_release_pinned_blocks() -> None:
    index = PrefixIndex(BT, capacity_blocks=3)
    refs = index.insert(_chain(1, 2))
    index.pin([refs[0].block_id, refs[1].block_id])
    result = index.resize(0)
    assert result.capacity_blocks == 2  # the target was 0; two blocks are in use by a request
    assert result.released_block_ids == [2]
    assert index.capacity_blocks == 2


def test_resize_grow_adds_ids_the_tier_must_back() -> None:
    index = PrefixIndex(BT, capacity_blocks=2)
    index.insert(_chain(1, 2))
    index.resize(1)  # evicts block 1 (the tail)
    result = index.resize(4)
    assert result.capacity_blocks == 4
    assert sorted(result.added_block_ids) == [1, 2, 3]
    assert len(index.free_block_ids()) == 3
    assert len(index.insert(_chain(2, 3))) == 3


def test_stats_count_hits_misses_and_use() -> None:
    index = PrefixIndex(BT, capacity_blocks=8)
    index.insert(_chain(1, 2))
    index.match(_chain(1, 3))  # 2 hits, 1 miss
    index.match(_chain(2, 2))  # 2 misses
    stats = index.stats()
    assert (stats.lookups, stats.hit_blocks, stats.miss_blocks) == (2, 2, 3)
    assert stats.used_blocks == 2 and stats.capacity_blocks == 8 and stats.pinned_blocks == 0
    assert stats.hit_rate == pytest.approx(2 / 5)


@pytest.mark.parametrize("kwargs, param", [({"block_tokens": 0, "capacity_blocks": 4}, "block_tokens"),
                                           ({"block_tokens": 4, "capacity_blocks": -1}, "capacity_blocks")])
def test_bad_sizes_are_config_errors_naming_the_parameter(kwargs: dict[str, int], param: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrefixIndex(**kwargs)
    assert info.value.param == param


def test_resize_with_keep_last_gives_back_the_other_ids_first() -> None:
    index = PrefixIndex(4, 6)
    index.insert(list(range(16)))  # ids 0..3 hold a chain; 4 and 5 are free
    in_pool = {0, 1, 4}  # ids whose memory is costly to give back (the shared tier's pool blocks)
    result = index.resize(2, keep_last=lambda b: b in in_pool)
    # free others (5), evicted others (the chain's tail first: 3, 2), then free kept ones (4); 0 and 1 stay
    assert result.released_block_ids == [2, 3, 4, 5] and result.evicted_block_ids == [3, 2]
    assert index.capacity_blocks == 2 and index.used_blocks == 2


def test_drop_free_gives_back_exactly_the_named_free_ids() -> None:
    index = PrefixIndex(4, 4)
    (ref,) = index.insert(list(range(4)))
    assert ref.block_id == 0
    assert index.drop_free([0, 1, 3, 9]) == [1, 3]  # 0 holds a block, 9 is not the index's
    assert index.capacity_blocks == 2 and index.free_block_ids() == [2]
    assert index.digest_of(0) == ref.digest and index.digest_of(2) is None



def test_a_shrink_asks_about_the_ids_it_gives_back_not_every_free_id() -> None:
    # A tier on a large card owns up to MAX_TIER_BLOCKS ids, and a KV pool short of blocks (KV by use) asks it for
    # a few back at nearly every step while prompts arrive: a pass over every free id each time (O(ids) calls of
    # `keep_last`) made a long prompt's first token seconds later. As the tier starts: the first ids are backed by
    # KV pool blocks, the last few are the tier's own.
    index = PrefixIndex(4, 100_000)
    pool = set(range(95_000))
    asked: list[int] = []

    def own(block_id: int) -> bool:  # a pool short of blocks asks: the pool's ids go first, own ones last
        asked.append(block_id)
        return block_id not in pool

    first = index.resize(100_000 - 20, keep_last=own).released_block_ids
    assert len(first) == 20 and all(b in pool for b in first)
    assert len(asked) <= 5_000 + 20  # past the own ids above them, then the 20 it gives: not 100,000
    asked.clear()

    def pooled(block_id: int) -> bool:  # anyone else asks: own ids first
        asked.append(block_id)
        return block_id in pool

    second = index.resize(100_000 - 40, keep_last=pooled).released_block_ids
    assert len(second) == 20 and all(b not in pool for b in second)
    assert len(asked) == 20
    # a growth takes the ids given back again, lowest first, before any new one
    assert index.resize(100_000 - 30).added_block_ids == sorted(first + second)[:10]
    assert len(index.free_block_ids()) == 100_000 - 30
