"""`--expert-cache-mib auto`: the expert cache takes >= 90 % of what the books leave, and being the claimant that
fills the card, it is the first asked for room when a graph capture runs out of memory (then the tier)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.exec.experts.setup import AUTO_SHARE, auto_budget_mib, grow_auto, start_expert_cache
from tests.fault_injection import FaultPlan
from engine.exec.graphs.backends import CpuGraphBackend
from engine.exec.graphs.cache import GraphCache
from engine.exec.kv.tier import VramBudget
from engine.model import load_checkpoint
from engine.switches import SwitchBoard
from engine.telemetry import EventBus
from tests.engine.exec.test_vram_tier import _tier


def _auto_cache(bus: EventBus):
    model = load_checkpoint("random:moe-synth-tiny", device="cpu").model
    return start_expert_cache("auto", model, torch.device("cpu"), bus, free_mib=0.0, reserve_mib=0.0)


@pytest.mark.parametrize("free_mib", [0.3, 0.6, 0.9])
def test_auto_takes_at_least_90_percent_of_what_is_left(free_mib):
    cache = _auto_cache(EventBus())
    assert cache.slots == 1  # one slot per layer until the KV cache and the runner's buffers are allocated
    reserve_mib, before_mib = 0.05, cache.mib
    left_mib = free_mib + before_mib - reserve_mib
    grow_auto(cache, "auto", free_mib, reserve_mib)
    assert cache.mib <= AUTO_SHARE * left_mib + 1e-9  # never past its share: the rest is the graphs' and tier's
    assert cache.mib >= 0.9 * left_mib - cache.num_layers * cache.expert_mib  # whole slots: within one of 90 %
    assert cache.target_slots == cache.slots < cache.num_experts


def test_auto_stops_at_every_expert_and_a_number_is_left_alone():
    cache = _auto_cache(EventBus())
    grow_auto(cache, "auto", free_mib=1e6, reserve_mib=0.0)
    assert cache.slots == cache.num_experts
    grow_auto(cache, 1, free_mib=0.0, reserve_mib=0.0)  # a budget in MiB is not auto's to change
    assert cache.slots == cache.num_experts
    assert auto_budget_mib(100.0, 200.0, 0.0) == 0.0  # the reserve is never handed out


def test_a_bad_auto_value_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        EngineConfig(expert_cache_mib="autox").validate()
    text = str(err.value)
    assert "expert_cache_mib" in text and "autox" in text and "\n" not in text


def _spy(claimant, name: str, calls: list[str]) -> None:
    release = claimant.release
    claimant.release = lambda mib, reason: calls.append(name) or release(mib, reason)


def test_capture_oom_shrinks_the_auto_expert_cache_first_then_the_tier():
    bus = EventBus()
    cache = _auto_cache(bus)
    grow_auto(cache, "auto", free_mib=1e6, reserve_mib=0.0)
    tier, _, kv, _ = _tier(preallocate=True, budget_blocks=8)
    budget = VramBudget(torch.device("cpu"), reserve_mib=0.0, weights_mib=0, kv_mib=kv.mib, tier=tier,
                        experts=cache, experts_first=True)
    calls: list[str] = []
    _spy(cache, "experts", calls)
    _spy(tier, "tier", calls)
    # the injected capture failure asks for 20 MiB: more than the tiny cache holds, so the tier gives the rest
    graphs = GraphCache("cpu", bus, SwitchBoard.from_values({}), budget.make_room, wait_polls=2,
                        fault_plan=FaultPlan.parse("capture:draft_round:1:oom"), default_need_mib=0.0,
                        switch_for_key=lambda kind, key: None, backend=CpuGraphBackend(None), sleep=lambda s: None)
    out = graphs.run("draft_round", "b1", lambda ins: {"y": ins["x"] + 1}, {"x": torch.zeros(2)}, owner="drafter")
    assert out["y"].tolist() == [1.0, 1.0]  # captured on the retry: serving goes on
    assert calls == ["experts", "tier"] and cache.slots == cache.min_slots
    shrink = [e for e in bus.history() if e.type == "expert" and e.action == "shrink"]
    assert shrink and "draft_round" in shrink[-1].reason and "out of memory" in shrink[-1].reason
    waits = [e for e in bus.history() if e.type == "graph" and e.action == "wait"]
    assert waits and waits[0].mib > 0 and "out of memory" in waits[0].error


def test_a_small_ask_is_answered_by_the_auto_expert_cache_alone():
    cache = _auto_cache(EventBus())
    grow_auto(cache, "auto", free_mib=1e6, reserve_mib=0.0)
    tier, _, kv, _ = _tier(preallocate=True, budget_blocks=8)
    budget = VramBudget(torch.device("cpu"), reserve_mib=0.0, weights_mib=0, kv_mib=kv.mib, tier=tier,
                        experts=cache, experts_first=True)
    slots = cache.slots
    freed = budget.make_room(0.2, "a step out of memory")
    assert freed >= 0.2 and cache.slots < slots and tier.capacity_blocks == 8


def test_without_auto_the_tier_still_gives_first():
    cache = _auto_cache(EventBus())
    grow_auto(cache, "auto", free_mib=1e6, reserve_mib=0.0)
    tier, _, kv, _ = _tier(preallocate=True, budget_blocks=8)
    budget = VramBudget(torch.device("cpu"), reserve_mib=0.0, weights_mib=0, kv_mib=kv.mib, tier=tier, experts=cache)
    slots = cache.slots
    budget.make_room(2 * tier.block_mib, "a step out of memory")
    assert tier.capacity_blocks == 6 and cache.slots == slots


def test_an_auto_engine_books_the_cache_and_asks_it_first():
    from tests.engine.engine_helpers import make_engine, one_thread

    with one_thread():
        engine = make_engine("random:moe-synth-tiny", batch=2, expert_cache_mib="auto")
        try:
            cache = engine.lm.model.expert_provider
            books = engine.budget.breakdown()
            assert engine.budget.experts_first and books.experts_mib == round(cache.mib, 1) > 0
            assert cache.slots == cache.num_experts  # the host's free memory holds every expert of the tiny model
        finally:
            engine.close()
    with one_thread():
        engine = make_engine("random:moe-synth-tiny", batch=2, expert_cache_mib=1)
        try:
            assert not engine.budget.experts_first  # a budget the user gave: the tier gives first, as before
        finally:
            engine.close()
