"""The out-of-memory path of GraphCache, every step, on the CPU graph backend.

Two ways to run out of memory here: fault injection (the exact errors CUDA raises, at the exact stage), and
the CPU backend's modelled capacity (an instantiate that does not fit fails; evicting or shrinking the tier
really makes room).
"""

from __future__ import annotations

import pytest
import torch

from engine.exec.step_fns import GraphDegraded
from tests.fault_injection import FaultPlan
from engine.exec.gpu_errors import StickyCudaError
from engine.exec.graphs.backends import CpuGraphBackend
from engine.exec.graphs.cache import GraphCache
from engine.switches import SwitchBoard
from engine.telemetry import EventBus

MIB_FLOATS = (1 << 20) // 4


class Tier:
    """The adaptive tier's contract: `release(mib, reason) -> float` gives back what it can."""

    def __init__(self, held_mib: float = 0.0) -> None:
        self.held_mib = held_mib
        self.calls: list[tuple[float, str]] = []

    def release(self, mib: float, reason: str) -> float:
        self.calls.append((mib, reason))
        given = min(mib, self.held_mib)
        self.held_mib -= given
        return given


def _cache(plan: str = "", capacity_mib: float | None = None, tier: Tier | None = None, polls: int = 4,
           switch: str | None = "SPLIT_ATTN") -> tuple[GraphCache, Tier, list[float]]:
    tier = tier or Tier()
    sleeps: list[float] = []
    cache = GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), tier.release, wait_polls=polls,
                       wait_interval_s=0.08, fault_plan=FaultPlan.parse(plan) if plan else FaultPlan(),
                       switch_for_key=lambda kind, key: switch if kind != "draft_round" else None,
                       backend=CpuGraphBackend(capacity_mib, others_mib=lambda: tier.held_mib), sleep=sleeps.append)
    return cache, tier, sleeps


def _step(ins):
    return {"y": ins["x"] + 1.0}


def _mib_input() -> dict:
    return {"x": torch.zeros(MIB_FLOATS)}  # a 2 MiB graph: 1 MiB in, 1 MiB out


def _events(cache: GraphCache) -> list[tuple[str, str]]:
    return [(e.action, e.kind) for e in cache.bus.history() if e.type == "graph"]


def _errors(cache: GraphCache) -> list[str]:
    return [e.error for e in cache.bus.history() if e.type == "graph" and e.error is not None]


def test_evict_own_graphs_and_retry_once_recovers_without_the_tier() -> None:
    cache, tier, _ = _cache("instantiate:draft_round:2:oom")
    x = {"x": torch.zeros(4)}
    cache.run("decode", "b4", _step, x)
    cache.run("draft_round", ("b4", 1), _step, x, owner="drafter")
    cache.run("draft_step", ("b4", 1), _step, x, owner="drafter")
    out = cache.run("draft_round", ("b4", 2), _step, {"x": torch.ones(4)}, owner="drafter")
    assert out["y"].tolist() == [2.0] * 4
    assert _events(cache)[3:] == [("evict", "draft_round"), ("evict", "draft_step"), ("retry", "draft_round"),
                                  ("capture", "draft_round")]
    assert tier.calls == []
    evict_error = _errors(cache)[0]
    assert evict_error.startswith("draft_round graph (b4, 2) instantiate: RuntimeError: CUDA error: out of memory")
    # Only the owner's graphs went; decode (another owner) stayed.
    assert sorted(g.kind for g in cache.snapshot().graphs) == ["decode", "draft_round"]


def test_a_fresh_owner_with_nothing_to_free_waits_for_the_tier() -> None:
    cache, tier, sleeps = _cache("capture:draft_round:1-2:invalidated", tier=Tier(held_mib=512.0))
    cache.run("draft_round", "b1", _step, {"x": torch.zeros(2)}, owner="drafter")
    # The first retry fails too (the second injected fault) after the tier gave: the tier is asked again.
    assert _events(cache) == [("wait", "draft_round"), ("wait", "draft_round"), ("capture", "draft_round")]
    (need, reason), (again, _) = tier.calls
    assert need == again == 256.0 and "draft_round" in reason and "out of memory" in reason
    wait = next(e for e in cache.bus.history() if e.type == "graph" and e.action == "wait")
    assert wait.mib == 256.0
    assert "operation failed due to a previous error during capture" in wait.error
    assert "caused by OutOfMemoryError: CUDA out of memory" in wait.error
    assert sleeps == [0.08]  # first poll immediately, the second after one interval


def test_persistent_oom_fails_degrades_and_never_captures_that_key_again() -> None:
    cache, tier, sleeps = _cache("instantiate:draft_round:*:oom", polls=4)
    cache.run("draft_step", ("b1", 1), _step, {"x": torch.zeros(2)}, owner="drafter")
    with pytest.raises(GraphDegraded) as err:
        cache.run("draft_round", "b1", _step, {"x": torch.zeros(2)}, owner="drafter")
    assert err.value.switch is None and err.value.kind == "draft_round"  # the runner turns MTP off
    assert "RuntimeError: CUDA error: out of memory" in err.value.error and "vram free unknown" in err.value.error
    assert _events(cache)[1:] == [("evict", "draft_step"), ("retry", "draft_round"), ("wait", "draft_round"),
                                  ("fail", "draft_round"), ("degrade", "draft_round")]
    assert cache.fault_plan.attempts("instantiate", "draft_round") == 1 + 1 + 4  # bounded: first, retry, polls
    assert sleeps == [0.08] * 3
    degrade = [e for e in cache.bus.history() if e.type == "graph" and e.action == "degrade"][0]
    assert degrade.error.startswith("mtp off: ")
    assert cache.snapshot().degraded[0].kind == "draft_round"
    # No retry storm: the key now runs eagerly, with no capture attempt and no event.
    before = len(cache.bus.history())
    out = cache.run("draft_round", "b1", _step, {"x": torch.ones(2)}, owner="drafter")
    assert out["y"].tolist() == [2.0, 2.0]
    assert cache.fault_plan.attempts("capture", "draft_round") == 6 and len(cache.bus.history()) == before


def test_the_responsible_switch_is_named() -> None:
    cache, _, _ = _cache("instantiate:verify:*:driver_oom", polls=1)
    with pytest.raises(GraphDegraded) as err:
        cache.run("verify", ("b6", "t2"), _step, {"x": torch.zeros(1)})
    assert err.value.switch == "SPLIT_ATTN"
    assert [e.error for e in cache.bus.history() if e.action == "degrade"][0].startswith("SPLIT_ATTN off: ")


def test_real_capacity_evicting_own_graphs_makes_room() -> None:
    cache, tier, _ = _cache(capacity_mib=7.0)
    cache.run("decode", "b1", _step, _mib_input())
    cache.run("draft_round", "r1", _step, _mib_input(), owner="drafter")
    cache.run("draft_step", "s1", _step, _mib_input(), owner="drafter")  # 6 of 7 MiB held
    cache.run("draft_round", "r2", _step, _mib_input(), owner="drafter")
    assert _events(cache)[3:] == [("evict", "draft_round"), ("evict", "draft_step"), ("retry", "draft_round"),
                                  ("capture", "draft_round")]
    assert _errors(cache)[0] == "draft_round graph r2 instantiate: RuntimeError: CUDA error: out of memory " \
                                "(vram free 1 MiB)"
    assert cache.backend.free_mib() == pytest.approx(3.0) and tier.calls == []


def test_real_capacity_the_tier_gives_memory_back() -> None:
    cache, tier, _ = _cache(capacity_mib=6.0, tier=Tier(held_mib=3.0))
    cache.run("decode", "b1", _step, _mib_input())  # 2 + tier 3 of 6 MiB
    cache.run("draft_round", "r1", _step, _mib_input(), owner="drafter")
    assert _events(cache)[1:] == [("wait", "draft_round"), ("capture", "draft_round")]
    assert tier.held_mib == 0.0 and len(tier.calls) == 1
    assert "vram free 1 MiB" in _errors(cache)[0]


def test_a_capture_still_short_after_the_tier_gave_asks_the_tier_again() -> None:
    # A warm-up makes many allocations and the failed one names only its own size: the first ask (1 MiB here)
    # is not enough, the retry fails again, and the tier, which still holds plenty, is asked again.
    tier = Tier(held_mib=5.5)
    cache = GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), tier.release, wait_polls=4,
                       wait_interval_s=0.0, fault_plan=FaultPlan(), default_need_mib=1.0,
                       backend=CpuGraphBackend(8.0, others_mib=lambda: tier.held_mib), sleep=lambda s: None)
    cache.run("decode", "b1", _step, _mib_input())  # 2 MiB + the tier's 5.5 of 8: 0.5 MiB free
    cache.run("draft_round", "r1", _step, _mib_input(), owner="drafter")  # needs 2 MiB
    assert _events(cache)[1:] == [("wait", "draft_round"), ("wait", "draft_round"), ("capture", "draft_round")]
    assert [mib for mib, _ in tier.calls] == [1.0, 1.0] and tier.held_mib == pytest.approx(3.5)
    waits = [e for e in cache.bus.history() if e.type == "graph" and e.action == "wait"]
    assert [e.mib for e in waits] == [1.0, 1.0]
    assert "vram free 0 MiB" in waits[0].error and "vram free 2 MiB" in waits[1].error


def test_real_capacity_nothing_to_free_degrades_and_keeps_other_owners_graphs() -> None:
    cache, tier, sleeps = _cache(capacity_mib=3.0, polls=5)
    cache.run("decode", "b1", _step, _mib_input())
    with pytest.raises(GraphDegraded):
        cache.run("draft_round", "r1", _step, _mib_input(), owner="drafter")
    assert [g.kind for g in cache.snapshot().graphs] == ["decode"]
    assert _events(cache)[1:] == [("wait", "draft_round"), ("fail", "draft_round"), ("degrade", "draft_round")]
    # Free VRAM never grew, so only the first and the last poll retried; the time bound still holds.
    assert cache.fault_plan.attempts("instantiate", "draft_round") == 1 + 2
    assert len(sleeps) == 4


def test_wait_polls_zero_skips_the_tier() -> None:
    cache, tier, sleeps = _cache("instantiate:decode:*:oom", polls=0)
    with pytest.raises(GraphDegraded):
        cache.run("decode", "b1", _step, {"x": torch.zeros(1)})
    assert tier.calls == [] and sleeps == []
    assert _events(cache) == [("fail", "decode"), ("degrade", "decode")]


def test_sticky_error_is_fatal_not_retried() -> None:
    cache, tier, _ = _cache("instantiate:verify:2:sticky")
    cache.run("decode", "b1", _step, {"x": torch.zeros(1)})
    cache.run("verify", "v0", _step, {"x": torch.zeros(1)})
    with pytest.raises(StickyCudaError) as err:
        cache.run("verify", "v1", _step, {"x": torch.zeros(1)})
    assert "illegal memory access" in err.value.message and err.value.to_event().fatal
    assert err.value.where == "graph instantiate verify v1"
    assert _events(cache) == [("capture", "decode"), ("capture", "verify")] and tier.calls == []


def test_a_non_memory_capture_error_degrades_at_once() -> None:
    cache, tier, _ = _cache("capture:decode:*:unsupported")
    cache.run("draft_round", "r", _step, {"x": torch.zeros(1)}, owner=None)
    with pytest.raises(GraphDegraded) as err:
        cache.run("decode", "b1", _step, {"x": torch.zeros(1)})
    assert "operation not permitted when stream is capturing" in err.value.error
    assert _events(cache)[1:] == [("fail", "decode"), ("degrade", "decode")] and tier.calls == []


@pytest.mark.parametrize("error", ["oom", "alloc_oom", "driver_oom", "invalidated", "no_error", "empty"])
def test_no_event_and_no_degrade_ever_says_no_error_or_nothing(error: str) -> None:
    cache, _, _ = _cache(f"instantiate:draft_step:*:{error}", polls=2)
    cache.run("draft_round", "r", _step, {"x": torch.zeros(1)}, owner="drafter")
    with pytest.raises(GraphDegraded) as err:
        cache.run("draft_step", "s", _step, {"x": torch.zeros(1)}, owner="drafter")
    texts = [err.value.error, str(err.value)] + _errors(cache)
    for text in texts:
        assert text and "no error" not in text.lower(), text
        assert "instantiate" in text
    if error != "empty":
        assert "out of memory" in err.value.error.lower()


def test_the_injected_tag_stays_visible_in_the_reported_error() -> None:
    cache, _, _ = _cache("instantiate:decode:1:oom", polls=1)
    cache.run("decode", "b1", _step, {"x": torch.zeros(1)})
    assert "[injected instantiate:decode:1:oom attempt 1]" in _errors(cache)[0]
