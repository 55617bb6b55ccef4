"""CAPTURE_ALL end to end on CPU: a real Engine over a GraphCache with the CPU graph backend.

With the switch on, every decode/verify/drafter bucket the runner and drafter list is captured while the engine
starts; a generation afterwards captures nothing new for those kinds and produces the same tokens as an eager
engine. A capture that fails at start degrades CAPTURE_ALL, never the engine.
"""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from tests.fault_injection import FaultPlan
from engine.exec.graphs.backends import CpuGraphBackend, key_text
from engine.exec.graphs.cache import GraphCache
from engine.exec.runner import switch_for_key
from engine.switches import SwitchBoard
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of, slot_keys

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(5, seed=31, lengths=(5, 150))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PRECAPTURED_KINDS = {"decode", "verify", "draft_prefill", "draft_round", "draft_step"}


def _cache(bus: EventBus, switches: dict[str, bool], plan: str = "") -> GraphCache:
    return GraphCache("cpu", bus, SwitchBoard.from_values(switches), lambda mib, reason: 0.0, wait_polls=1,
                      wait_interval_s=0.0, fault_plan=FaultPlan.parse(plan) if plan else FaultPlan(),
                      switch_for_key=switch_for_key, backend=CpuGraphBackend(), sleep=lambda s: None)


def _engine(ckpt, bus: EventBus, capture_all: bool, plan: str = "", **kw):
    switches = {"CAPTURE_ALL": capture_all, **kw.pop("switches", {})}
    cache = _cache(bus, switches, plan)
    engine = make_engine(ckpt, bus=bus, batch=3, executor=cache, switches=switches, **kw)
    return engine, cache


def _captures(bus: EventBus) -> list[tuple[str, str]]:
    return [(e.kind, e.key) for e in bus.history() if e.type == "graph" and e.action == "capture"]


@pytest.fixture(scope="module")
def reference_mtp(ckpt):
    with one_thread():
        return tokens_of(run_all(make_engine(ckpt, batch=3, batch_mtp=True, mtp_depth=2), PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def reference_plain(ckpt):
    with one_thread():
        return tokens_of(run_all(make_engine(ckpt, batch=3), PROMPTS, GREEDY))


def test_every_spec_is_captured_at_start_and_generation_captures_nothing_new(ckpt, reference_mtp):
    bus = EventBus(history=100000)
    engine, cache = _engine(ckpt, bus, True, batch_mtp=True, mtp_depth=2)
    specs = engine.runner.graph_specs() + engine.drafter.graph_specs(engine.config.prefill_chunk_tokens)
    held = {(g.kind, g.key) for g in cache.snapshot().graphs}
    wanted = {(s.kind, key_text(s.key)) for s in specs}
    assert wanted and wanted <= held
    # batch 3 -> buckets 1, 2, 4; context 1024 -> spans 256, 512, 1024; depth 2 -> one chain step kind.
    assert {k for k, _ in wanted} == {"verify", "draft_prefill", "draft_round", "draft_step"}
    assert len([k for k in wanted if k[0] == "verify"]) == 3 * 3
    at_start = len(_captures(bus))
    assert not engine.board.states["CAPTURE_ALL"].degraded

    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    later = [c for c in _captures(bus)[at_start:] if c[0] in PRECAPTURED_KINDS]
    assert later == []
    assert got == reference_mtp
    replayed = {(g.kind, g.key) for g in cache.snapshot().graphs if g.replays}
    assert {k for k, _ in replayed} >= {"verify", "draft_round", "draft_step"}  # the captured graphs were used


def test_with_the_fused_step_the_buckets_it_replaces_are_not_captured(ckpt, reference_mtp):
    bus = EventBus(history=100000)
    engine, cache = _engine(ckpt, bus, False, batch_mtp=True, mtp_depth=2)
    engine.drafter.fused = True  # the CUDA default, forced on the CPU backend
    specs = engine.runner.graph_specs(verify=False) + engine.drafter.graph_specs(engine.config.prefill_chunk_tokens)
    kinds = {s.kind for s in specs}
    assert kinds == {"verify_draft", "draft_prefill", "draft_step"}
    assert {key_text(s.key).split(",")[0] for s in specs if s.kind == "draft_step"} == {"(b1"}
    assert len([s for s in specs if s.kind == "verify_draft"]) == 3 * 3  # batch buckets x spans
    summary = cache.precapture(specs)
    assert summary["captured"] == len(specs)
    at_start = len(_captures(bus))
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert got == reference_mtp
    later = [c for c in _captures(bus)[at_start:] if c[0] in PRECAPTURED_KINDS | {"verify_draft"}]
    assert later == []  # greedy decoding needed nothing that was not captured at start


def test_without_mtp_the_decode_buckets_are_captured_and_outputs_match(ckpt, reference_plain):
    bus = EventBus(history=100000)
    engine, cache = _engine(ckpt, bus, True)
    kinds = {g.kind for g in cache.snapshot().graphs}
    assert kinds == {"decode"}
    at_start = len(_captures(bus))
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reference_plain
    assert [c for c in _captures(bus)[at_start:] if c[0] == "decode"] == []


def test_switch_off_captures_nothing_at_start(ckpt, reference_plain):
    bus = EventBus(history=100000)
    engine, cache = _engine(ckpt, bus, False)
    assert cache.snapshot().graphs == []
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reference_plain
    assert _captures(bus)  # lazily, on first need


def test_graphs_are_captured_before_the_tier_takes_the_memory_left(ckpt):
    """The tier is sized from what is free after the graphs, so a full tier never meets the start-up captures."""
    bus = EventBus(history=100000)
    _engine(ckpt, bus, True, batch_mtp=True, mtp_depth=1)
    kinds = [e.type for e in bus.history()]
    last_capture = max(i for i, e in enumerate(bus.history()) if e.type == "graph" and e.action == "capture")
    first_tier = kinds.index("tier")
    assert last_capture < first_tier


def test_precapture_does_not_disturb_real_slots(ckpt):
    """The warm-ups write only scratch columns: every slot's real KV columns stay untouched."""
    bus = EventBus()
    # every slot's own columns (reserved): by use, unmapped positions read the scratch block the warm-ups write
    engine, _ = _engine(ckpt, bus, True, batch_mtp=True, mtp_depth=2, kv_pool="reserved")
    context = engine.kv.geometry.context_tokens
    assert all(not slot_keys(engine.kv, i)[:, :, :context].any() for i in range(len(engine.kv.k)))
    assert all(not slot_keys(engine.kv, i, values=True)[:, :, :context].any() for i in range(len(engine.kv.v)))
    assert not engine.runner.draft_buf[: engine.runner.num_slots].any()


def test_a_failed_precapture_degrades_capture_all_and_generation_completes(ckpt, reference_mtp):
    bus = EventBus(history=100000)
    # Three failures: the first attempt, the retry after evicting the drafter's graphs, the tier poll.
    engine, cache = _engine(ckpt, bus, True, plan="instantiate:draft_round:1-3:oom", batch_mtp=True, mtp_depth=2)
    state = engine.board.states["CAPTURE_ALL"]
    assert state.degraded and not state.enabled
    assert "draft_round" in state.reason and "out of memory" in state.reason
    assert [e.state for e in bus.history() if e.type == "switch" and e.name == "CAPTURE_ALL"][-1] == "degraded"
    assert engine.health().ready
    assert cache.snapshot().degraded == []  # the bucket stays capturable lazily, not eager for the run
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert got == reference_mtp
    assert engine.mtp_on  # the later lazy capture of draft_round succeeded
    assert any(k == "draft_round" for k, _ in _captures(bus))


def test_an_executor_without_precapture_warns_and_runs_eagerly(ckpt, reference_plain):
    bus = EventBus(history=1000)
    engine = make_engine(ckpt, bus=bus, batch=3, switches={"CAPTURE_ALL": True})
    assert any("CAPTURE_ALL" in e.message for e in bus.history() if e.type == "warning")
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reference_plain
