"""Prefix reuse by reference (the tier's blocks in the KV pool, engine.exec.kv.tier_pool) through the whole engine:
the same greedy tokens as a fresh run and as the copy path, no KV copied between a slot and the tier, slots that
never write into the blocks they map (padded rows, rejected drafts, chunk padding), and a tier release while a
slot maps blocks."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.exec.kv.cache import SlotKVCache
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHARED = {"SHARED_PREFIX": True}  # asked for explicitly (it is also on by default)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TIER_TOKENS = 64  # one pool block per tier block (the engine's default 256 is four)


def _no_copies(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("KV was copied between a slot and the tier")

    monkeypatch.setattr(SlotKVCache, "read_span", refuse)
    monkeypatch.setattr(SlotKVCache, "write_span", refuse)


@pytest.mark.parametrize("kv,mtp", [("bf16", False), ("int8", False), ("bf16", True)])
def test_a_reused_prompt_maps_the_tier_blocks_and_matches_the_fresh_and_the_copy_paths(ckpt, kv, mtp, monkeypatch):
    prompt = random_prompts(1, seed=41, lengths=(300, 301))[0]
    copy_bus = EventBus(history=50000)
    copying = make_engine(ckpt, bus=copy_bus, batch=2, kv=kv, batch_mtp=mtp, mtp_depth=2, block_tokens=TIER_TOKENS,
                          kv_resident=1024, switches=SHARED)  # --kv-resident: the tier keeps its own blocks, copies
    assert copying.tier.shared is None
    state = {s["name"]: s for s in copying.board.snapshot()}["SHARED_PREFIX"]
    assert not state["enabled"] and "--kv-resident" in state["reason"]
    assert any(e.type == "warning" and "SHARED_PREFIX is off" in e.message for e in copy_bus.history())
    copy_first = tokens_of(run_all(copying, [prompt], GREEDY, prefix="a"))["a0"]
    copy_second = tokens_of(run_all(copying, [prompt], GREEDY, prefix="b"))["b0"]
    assert copying.tier.copied_in_blocks == 4
    bus = EventBus(history=50000)
    engine = make_engine(ckpt, bus=bus, batch=2, kv=kv, batch_mtp=mtp, mtp_depth=2, block_tokens=TIER_TOKENS, switches=SHARED)
    assert engine.tier.shared is not None
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    _no_copies(monkeypatch)
    second_outs = run_all(engine, [prompt], GREEDY, prefix="b")["b0"]
    assert second_outs[-1].cached_tokens == 256  # whole 64-token blocks of prompt[:-1]
    assert [t for o in second_outs for t in o.token_ids] == first == copy_first == copy_second
    assert (engine.tier.shared_blocks, engine.tier.copied_in_blocks) == (4, 0)
    assert engine.state().to_json()["tier"]["mib"] == pytest.approx(4 * engine.tier.block_mib, abs=0.01)


def test_slots_never_write_into_the_tier_blocks_they_map(ckpt):
    engine = make_engine(ckpt, batch=4, batch_mtp=True, mtp_depth=2, block_tokens=TIER_TOKENS, switches=SHARED)
    base = random_prompts(1, seed=42, lengths=(300, 301))[0]
    run_all(engine, [base], GREEDY, prefix="a")
    tier, shared = engine.tier, engine.tier.shared
    held = {b: shared.physical(b) for b in shared.backing if tier.index.digest_of(b) is not None}
    assert len(held) == 4
    before = {b: [t[:, phys].clone() for t in engine.kv.pools()] for b, phys in held.items()}
    # Three rows (a padded batch of 4), MTP drafts rejected and accepted, chunk padding, and, in the slot that
    # handed its blocks over, a prompt that shares three blocks and then writes its own fourth: nothing may
    # land in a tier block.
    prompts = [base[:200] + [9] * 90, base, base + [5] * 70]
    outs = run_all(engine, prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), prefix="b")
    assert [outs[f"b{i}"][-1].cached_tokens for i in range(3)] == [192, 256, 256]
    assert tier.shared_blocks == 4 + 3 + 4 and tier.copied_in_blocks == 0
    assert sum(engine.executor.draft_proposed) > sum(engine.executor.draft_accepted) > 0  # drafts were rejected along the way
    for b, phys in held.items():
        assert shared.physical(b) == phys
        for saved, pool in zip(before[b], engine.kv.pools()):
            assert torch.equal(pool[:, phys], saved)


def test_a_tier_release_while_a_slot_maps_blocks_keeps_them_and_the_output(ckpt):
    engine = make_engine(ckpt, batch=1, block_tokens=TIER_TOKENS, switches=SHARED)
    prompt, other = random_prompts(2, seed=43, lengths=(300, 301))
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    run_all(engine, [other], GREEDY, prefix="o")
    tier = engine.tier
    engine.add_request("b0", prompt, GREEDY)
    outs = list(engine.step())  # admitted: its 4 prefix blocks are mapped into the slot
    assert tier.index.stats().pinned_blocks == 4
    held_mib = tier.mib
    freed = tier.release(100 * tier.block_mib, "test")
    assert freed == pytest.approx(held_mib - 4 * tier.block_mib)  # all but the mapped blocks
    assert tier.mib == pytest.approx(4 * tier.block_mib)
    assert tier.index.stats().used_blocks == 4
    while engine.has_work:
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == first
    assert tier.index.stats().pinned_blocks == 0  # the finished request's mappings went with its slot


def test_a_pool_resize_drops_the_captured_graphs_and_the_next_steps_recapture_them(ckpt):
    from engine.exec.graphs.backends import CpuGraphBackend
    from engine.exec.graphs.cache import GraphCache
    from engine.exec.runner import switch_for_key
    from engine.switches import SwitchBoard

    bus = EventBus(history=100000)
    cache = GraphCache("cpu", bus, SwitchBoard.from_values({}), lambda mib, reason: 0.0, wait_polls=1,
                       wait_interval_s=0.0, switch_for_key=switch_for_key, backend=CpuGraphBackend(),
                       sleep=lambda s: None)
    # every slot's context reserved: the tier's blocks grow and shrink the pool tensors (by use they come from its
    # free blocks, and a release reallocates nothing)
    engine = make_engine(ckpt, bus=bus, batch=2, executor=cache, block_tokens=TIER_TOKENS, switches=SHARED,
                         kv_pool="reserved")
    prompt, other = random_prompts(2, seed=44, lengths=(300, 301))
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    run_all(engine, [other], GREEDY, prefix="o")
    engine.add_request("b0", prompt, GREEDY)
    outs = list(engine.step())
    assert cache.snapshot().graphs
    pool_blocks = engine.kv.k[0].shape[1]
    assert engine.tier.release(100 * engine.tier.block_mib, "test") > 0
    assert engine.kv.k[0].shape[1] == engine.kv.geometry.num_blocks + 4 < pool_blocks  # the mapped blocks stay
    assert cache.snapshot().graphs == []  # they held the old pool tensors
    while engine.has_work:
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == first
    assert any(g.replays for g in cache.snapshot().graphs)  # recaptured on the new tensors, replayed


def test_an_abort_right_after_a_hand_over_unmaps_the_slot_and_a_release_takes_the_discarded_blocks(ckpt):
    engine = make_engine(ckpt, batch=1, block_tokens=TIER_TOKENS, switches=SHARED)
    prompt = random_prompts(1, seed=45, lengths=(300, 301))[0]
    engine.add_request("a0", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()  # the first chunks ran: their blocks were handed over, the scheduler still pins them
    shared, tier = engine.tier.shared, engine.tier
    assert shared.mapped[0]
    engine.abort("a0")  # between steps: its unconfirmed blocks are discarded, its slot unmapped
    assert shared.mapped[0] == {} and tier.index.stats().pinned_blocks == 0
    held_mib = tier.mib
    assert held_mib > 0 and tier.release(100 * tier.block_mib, "test") == pytest.approx(held_mib)
    assert shared.backing == {} and tier.mib == 0
    again = tokens_of(run_all(engine, [prompt], GREEDY, prefix="b"))["b0"]
    fresh = tokens_of(run_all(make_engine(ckpt, batch=1, block_tokens=TIER_TOKENS, switches=SHARED), [prompt], GREEDY))["r0"]
    assert again == fresh


def test_a_capture_out_of_memory_shrinks_the_pool_around_a_mapped_prefix_and_the_output_holds(ckpt):
    from tests.fault_injection import FaultPlan
    from engine.exec.graphs.backends import CpuGraphBackend
    from engine.exec.graphs.cache import GraphCache
    from engine.exec.runner import switch_for_key
    from engine.switches import SwitchBoard

    bus, holder = EventBus(history=100000), {}
    cache = GraphCache("cpu", bus, SwitchBoard.from_values({}), lambda mib, why: holder["tier"].release(mib, why),
                       wait_polls=2, wait_interval_s=0.0, fault_plan=FaultPlan(), switch_for_key=switch_for_key,
                       backend=CpuGraphBackend(), sleep=lambda s: None)
    engine = make_engine(ckpt, bus=bus, batch=1, executor=cache, block_tokens=TIER_TOKENS, switches=SHARED,
                         kv_pool="reserved")  # the pool tensors shrink with the tier (by use they do not)
    holder["tier"] = engine.tier
    prompt, other = random_prompts(2, seed=46, lengths=(300, 301))
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    run_all(engine, [other], GREEDY, prefix="o")
    engine.add_request("b0", prompt, GREEDY)
    outs = list(engine.step())  # admitted (its prefix mapped), its tail prefilled: the next steps decode
    cache.invalidate(lambda kind, key: True)  # the decode graph is captured again, and that capture fails:
    # twice, so evicting the cache's own graphs is not enough and the tier must give
    cache.fault_plan = FaultPlan.parse("instantiate:decode:1-2:oom")
    pool_blocks = engine.kv.k[0].shape[1]
    while engine.has_work:
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == first
    shrinks = [e for e in bus.history() if e.type == "tier" and e.action == "shrink"]
    assert shrinks and "graph decode" in shrinks[-1].reason
    assert engine.kv.k[0].shape[1] < pool_blocks and engine.tier.shared_blocks == 4
    actions = [e.action for e in bus.history() if e.type == "graph" and e.kind == "decode"]
    assert "wait" in actions and actions[-1] in ("capture", "release") and "degrade" not in actions


def test_on_by_default_where_it_cannot_apply_it_is_marked_off_with_the_reason_but_warns_nobody(ckpt):
    """SHARED_PREFIX is on by default: a `--kv-resident` engine that never asked for it gets the reason in its
    switch state, not a WARNING on every start (the engine asked explicitly still warns: the test above)."""
    bus = EventBus(history=5000)
    engine = make_engine(ckpt, bus=bus, batch=2, block_tokens=TIER_TOKENS, kv_resident=1024)
    assert engine.tier.shared is None
    state = {s["name"]: s for s in engine.board.snapshot()}["SHARED_PREFIX"]
    assert not state["enabled"] and "--kv-resident" in state["reason"]
    assert not [e for e in bus.history() if e.type == "warning" and "SHARED_PREFIX" in e.message]
    plain = make_engine(ckpt, batch=2, block_tokens=TIER_TOKENS)
    assert plain.tier.shared is not None  # on by default where it applies


def test_a_long_prompts_blocks_grow_the_pool_once_not_once_per_chunk(ckpt):
    """A host tier (a CPU engine's) backs its blocks in the pool as they are filled, and each growth reallocates and
    copies the whole pool (every layer's keys and values): a prompt handed over a chunk's blocks at a time grew it
    again and again on the way to its first token. The first fill makes room for the prompt's later blocks at once."""
    prompt = random_prompts(1, seed=47, lengths=(1500, 1501))[0]  # 23 tier blocks in 24 chunks of 64 tokens
    engine = make_engine(ckpt, batch=2, context=2048, block_tokens=TIER_TOKENS, tier_budget_mib=64.0, switches=SHARED,
                         kv_pool="reserved")
    reallocations: list[int] = []
    resize = engine.kv.resize_pool
    engine.kv.resize_pool = lambda n, stage, **kw: (reallocations.append(n), resize(n, stage, **kw))[1]
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    assert len(reallocations) == 1 and len(engine.tier.shared.backing) >= 23
    second = run_all(engine, [prompt], GREEDY, prefix="b")["b0"]  # reused: its blocks map what was handed over
    assert second[-1].cached_tokens == 1472 and [t for o in second for t in o.token_ids] == first
    assert len(reallocations) == 1


def test_by_use_the_tier_backs_its_blocks_with_free_pool_blocks_and_a_release_frees_them_for_the_slots(ckpt):
    """KV by use (the CPU default): the tier's blocks come from the pool the slots take blocks from; a release puts
    them back on its free list (no pool tensor is reallocated), and a reuse maps them as before."""
    prompt = random_prompts(1, seed=48, lengths=(700, 701))[0]
    engine = make_engine(ckpt, batch=2, context=2048, block_tokens=TIER_TOKENS, tier_budget_mib=64.0, switches=SHARED)
    ledger = engine.kv.paging.ledger
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    engine.step()  # the finished slot's blocks go back
    tier_blocks = len(engine.tier.shared.backing)
    assert tier_blocks == 10 and ledger.free_pool_blocks == ledger.pool_blocks - tier_blocks
    second = run_all(engine, [prompt], GREEDY, prefix="b")["b0"]
    assert second[-1].cached_tokens == 640 and [t for o in second for t in o.token_ids] == first
    engine.step()
    pool_tensor_blocks = engine.kv.k[0].shape[1]
    assert engine.tier.release(100 * engine.tier.block_mib, "test") > 0
    assert engine.tier.shared.backing == {} and ledger.free_pool_blocks == ledger.pool_blocks
    assert engine.kv.k[0].shape[1] == pool_tensor_blocks
