"""The seed report's scenario end to end on CPU, with the real graph cache (its CPU backend) and its fault
injection standing in for the GPU running out of memory at a drafter graph's instantiate:

six slots decode with --batch-mtp and SPLIT_ATTN, a fresh long prompt arrives, and the draft_round graph's
instantiate fails for memory. Expected (the issue): the real error, never "no error"; the cache frees its own
graphs, asks the tier for room and polls; then SPLIT_ATTN is degraded with a WARNING, the step is retried
without it, MTP keeps drafting, and every request completes with the tokens a plain run gives.
"""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from tests.fault_injection import FaultPlan
from engine.exec.graphs.cache import GraphCache
from engine.exec.runner import switch_for_key
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = random_prompts(6, seed=60, lengths=(20, 60))
LONG = random_prompts(1, seed=61, lengths=(1500, 1501))[0]


def _run(engine, short_tokens: int = 40):
    for i, prompt in enumerate(SHORT):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=short_tokens, temperature=0.0, ignore_eos=True))
    outs: dict[str, list] = {}
    for _ in range(6):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.add_request("long", LONG, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


COMMON = dict(batch=7, context=2048, kv="int8", prefill_chunk_tokens=256, step_token_budget=512)


@pytest.fixture(scope="module")
def reference(ckpt):
    with one_thread():
        return tokens_of(_run(make_engine(ckpt, **COMMON)))


def _faulty_engine(ckpt, bus: EventBus, faults: str):
    engine = make_engine(ckpt, bus=bus, batch_mtp=True, mtp_depth=2, switches={"SPLIT_ATTN": True}, **COMMON)
    engine.kv.split_tokens = 128  # so these spans really take the split-KV path
    # Every instantiate attempt in `faults` fails for memory: the first failing key needs 4 attempts to
    # degrade (capture, retry after freeing its own graphs, 2 polls for tier room).
    cache = GraphCache(engine.device, bus, engine.board, release_tier=engine.tier.release, wait_polls=2,
                       wait_interval_s=0.0, fault_plan=FaultPlan.parse(faults), switch_for_key=switch_for_key,
                       streams=engine.streams)
    engine.graphs = engine.runner.graphs = cache
    return engine


def test_seed_scenario_degrades_split_attn_and_every_request_completes(ckpt, reference):
    bus = EventBus(history=200000)
    engine = _faulty_engine(ckpt, bus, "instantiate:draft_round:2-5:oom")
    outs = _run(engine)

    assert engine.health().ready, engine.health().reason
    assert {rid: seq[-1].finish_reason for rid, seq in outs.items()} == {rid: "length" for rid in reference}
    assert tokens_of(outs) == reference
    split = engine.board.states["SPLIT_ATTN"]
    assert split.degraded and "out of memory" in split.reason and "no error" not in split.reason
    assert engine.mtp_on, engine.mtp_off_reason  # only the switch was turned off
    events = bus.history()
    graph_actions = [e.action for e in events if e.type == "graph"]
    assert "degrade" in graph_actions
    warnings = [e.message for e in events if e.type == "warning"]
    assert any("SPLIT_ATTN" in m and "out of memory" in m for m in warnings)
    assert not [e for e in events if e.type == "error" and e.fatal]


def test_when_the_drafter_cannot_get_a_graph_even_without_the_switch_mtp_turns_off(ckpt, reference):
    bus = EventBus(history=200000)
    engine = _faulty_engine(ckpt, bus, "instantiate:draft_round:2-30:oom")
    outs = _run(engine)
    assert engine.health().ready, engine.health().reason
    assert tokens_of(outs) == reference
    assert engine.board.states["SPLIT_ATTN"].degraded
    assert not engine.mtp_on and "out of memory" in engine.mtp_off_reason
    warnings = [e.message for e in bus.history() if e.type == "warning"]
    assert any("MTP drafting turned off" in m for m in warnings)
