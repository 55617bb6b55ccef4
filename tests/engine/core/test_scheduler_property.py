"""Property test: random interleavings of add, step, abort and tier resizes keep the scheduler's invariants,
and every admitted request that is not aborted finishes with all its tokens."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.errors import QueueFull
from engine.core.prefix_index import PrefixIndex
from engine.core.request import Request, RequestState
from engine.core.scheduler import Scheduler, StepPlan

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BT = 4
NUM_SLOTS = 3
CHUNK = 12
BUDGET = 16

_add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 40), st.integers(1, 6))
_step = st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0))
# A step during which one running request is aborted after planning, before its chunk "runs".
_step_abort = st.tuples(st.just("step_abort"), st.integers(0, NUM_SLOTS - 1), st.integers(0, 0), st.integers(0, 0))
_abort = st.tuples(st.just("abort"), st.integers(0, 30), st.integers(0, 0), st.integers(0, 0))
_resize = st.tuples(st.just("resize"), st.integers(0, 24), st.integers(0, 0), st.integers(0, 0))
_drafts = st.tuples(st.just("drafts"), st.integers(0, 3), st.integers(0, 0), st.integers(0, 0))
OPS = st.lists(st.one_of(_add, _step, _step, _step, _step_abort, _abort, _resize, _drafts), max_size=60)


def _check_slots(sched: Scheduler) -> None:
    holders = [sched.slot_request(slot) for slot in range(NUM_SLOTS)]
    held = [r for r in holders if r is not None]
    assert len({id(r) for r in held}) == len(held), "a request holds two slots"
    for slot, r in enumerate(holders):
        if r is not None:
            assert r.slot == slot and r.state in (RequestState.PREFILL, RequestState.DECODE)
    assert sched.num_slots - sched.num_running == NUM_SLOTS - len(held)
    for r in sched.waiting():
        assert r.state is RequestState.WAITING and r.slot is None


def _check_plan(sched: Scheduler, plan: StepPlan) -> None:
    slots = [a.slot for a in plan.admitted] + [c.slot for c in plan.prefill] + [r.slot for r in plan.decode]
    stepped = {c.slot for c in plan.prefill} | {r.slot for r in plan.decode}
    assert len(stepped) == len(plan.prefill) + len(plan.decode), "a slot is in a plan twice"
    assert all(s is not None for s in slots)
    assert plan.num_prefill_tokens <= max(0, BUDGET - plan.num_decode_tokens)
    assert all(0 < c.num_tokens <= CHUNK for c in plan.prefill)
    assert plan.prefill or plan.decode or not sched.has_work, "work is waiting but the plan is empty"
    index = sched.prefix_index
    pinned_now = {ref.block_id for a in plan.admitted for ref in a.cached_blocks}
    pinned_now |= {ref.block_id for fill in plan.cache_fill for ref in fill.blocks}
    assert index.stats().pinned_blocks == len(pinned_now), "pins outlived their step"
    assert all(index.is_pinned(block_id) for block_id in pinned_now)
    assert index.used_blocks <= index.capacity_blocks


def _run(sched: Scheduler, plan: StepPlan, filled: dict[int, tuple[int, ...]]) -> None:
    """Play the runner: sample, then fill the tier (recording which prompt block each id holds), end the step."""
    stepped = [c.request for c in plan.prefill if c.is_last] + plan.decode
    for r in [r for r in stepped if not r.is_finished]:  # aborted after planning: nothing to sample
        result = r.append_output([7] * (1 + plan.draft_tokens), now_s=0.0)
        if result.finish_reason is not None:
            sched.finish(r, result.finish_reason)
    for fill in plan.cache_fill:
        if fill.should_fill:
            for ref in fill.blocks:
                filled[ref.block_id] = tuple(fill.request.prompt_token_ids[ref.index * BT:(ref.index + 1) * BT])
    sched.end_step()


def _check_reuse(plan: StepPlan, filled: dict[int, tuple[int, ...]]) -> None:
    """Every reused block holds exactly the tokens of the prompt position it is copied to."""
    for adm in plan.admitted:
        for ref in adm.cached_blocks:
            want = tuple(adm.request.prompt_token_ids[ref.index * BT:(ref.index + 1) * BT])
            assert filled.get(ref.block_id) == want, "a reused block was never filled with these tokens"


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_workloads_keep_the_invariants_and_finish_everything(ops: list[tuple[str, int, int, int]]) -> None:
    index = PrefixIndex(BT, capacity_blocks=16)
    sched = Scheduler(NUM_SLOTS, 4, CHUNK, BUDGET, index, BT, context_tokens=64)
    accepted: list[Request] = []
    aborted: set[str] = set()
    admitted_order: list[str] = []
    filled: dict[int, tuple[int, ...]] = {}  # tier block id -> the tokens whose KV the "runner" wrote there
    for op, a, b, c in ops:
        if op == "add":
            # Three prompt families with shared heads, so prefixes get reused and evicted.
            r = Request(f"r{len(accepted)}", [a * 1000 + i for i in range(b)], SamplingParams(max_tokens=c))
            try:
                sched.add(r)
                accepted.append(r)
            except QueueFull:
                assert sched.num_waiting == 4
        elif op in ("step", "step_abort"):
            plan = sched.schedule()
            admitted_order += [adm.request.request_id for adm in plan.admitted]
            _check_plan(sched, plan)
            _check_reuse(plan, filled)
            victim = sched.slot_request(a) if op == "step_abort" else None
            if victim is not None:
                sched.abort(victim.request_id)
                aborted.add(victim.request_id)
            _run(sched, plan, filled)
        elif op == "abort" and a < len(accepted):
            if sched.abort(accepted[a].request_id) is not None:
                aborted.add(accepted[a].request_id)
            # An aborted request's pins go at once, not at the next step (a tier shrink may come first).
            assert all(not r.blocks_pinned for r in accepted if r.is_finished)
        elif op == "resize":
            index.resize(a)
        elif op == "drafts":
            sched.set_draft_tokens(a)
        _check_slots(sched)
    for _ in range(500):
        if not sched.has_work:
            break
        plan = sched.schedule()
        admitted_order += [adm.request.request_id for adm in plan.admitted]
        _check_plan(sched, plan)
        _check_reuse(plan, filled)
        _run(sched, plan, filled)
        _check_slots(sched)
    assert not sched.has_work, "requests were left unfinished"
    expected_order = [r.request_id for r in accepted if r.request_id in admitted_order]
    assert admitted_order == expected_order, "admission was not FIFO"
    for r in accepted:
        assert r.is_finished
        if r.request_id not in aborted:
            assert r.finish_reason == "length" and r.num_output_tokens == r.max_tokens
    assert index.stats().pinned_blocks == 0, "an idle scheduler still pins tier blocks"
