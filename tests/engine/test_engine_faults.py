"""Fault injection at the step-executor seam: a GraphDegraded raised by the executor on its Nth call degrades
the responsible switch (or turns MTP off) and every request still completes with the same tokens; any other
exception in a step is reported with its real message and ends the engine cleanly."""

from __future__ import annotations

from typing import Any, Callable, Hashable

import pytest

from engine.api import SamplingParams
from engine.exec.step_fns import EagerExecutor, GraphDegraded
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(6, seed=77, lengths=(5, 90))
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
OOM = "CUDA error: out of memory (instantiate: out of memory, vram free 2 MiB)"


class FailingExecutor(EagerExecutor):
    """Runs steps eagerly, but raises `error(kind, key)` on the Nth call whose (kind, key) matches."""

    def __init__(self, match: Callable[[str, Hashable], bool], nth: int, error: Callable[[str, Hashable], Exception]):
        self.match, self.nth, self.error = match, nth, error
        self.calls = 0
        self.raised = 0
        self.invalidated: list[tuple[str, Hashable]] = []
        self.seen: list[tuple[str, Hashable]] = []

    def run(self, kind: str, key: Hashable, fn, inputs, owner: str | None = None) -> dict[str, Any]:
        self.seen.append((kind, key))
        if self.match(kind, key):
            self.calls += 1
            if self.calls == self.nth:
                self.raised += 1
                raise self.error(kind, key)
        return fn(inputs)

    def invalidate(self, predicate) -> None:
        self.invalidated.extend(k for k in self.seen if predicate(*k))


@pytest.fixture(scope="module")
def reference(ckpt):
    with one_thread():
        return tokens_of(run_all(make_engine(ckpt, batch=3), PROMPTS, GREEDY))


def _events(bus: EventBus, kind: str) -> list:
    return [e for e in bus.history() if e.type == kind]


def test_degraded_switch_is_turned_off_and_the_step_retried_without_it(ckpt, reference):
    bus = EventBus(history=50000)
    executor = FailingExecutor(lambda kind, key: kind == "draft_round" and key.depends_on("SPLIT_ATTN"), nth=3,
                               error=lambda kind, key: GraphDegraded(kind, key, "SPLIT_ATTN", OOM))
    engine = make_engine(ckpt, bus=bus, batch=3, batch_mtp=True, mtp_depth=2, executor=executor,
                         switches={"SPLIT_ATTN": True})
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert executor.raised == 1
    assert got == reference  # every request completed, token for token
    state = engine.board.states["SPLIT_ATTN"]
    assert not state.enabled and state.degraded and "out of memory" in state.reason
    assert engine.mtp_on  # MTP itself survives: only the switch was to blame
    assert [e.state for e in _events(bus, "switch") if e.name == "SPLIT_ATTN"][-1] == "degraded"
    assert any("SPLIT_ATTN" in w.message and "out of memory" in w.message for w in _events(bus, "warning"))
    assert executor.invalidated and all(key.depends_on("SPLIT_ATTN") for _, key in executor.invalidated)
    assert not any(key.depends_on("SPLIT_ATTN") for _, key in executor.seen[-5:])  # later steps run without the switch


@pytest.mark.parametrize("failing_kind", ["verify", "draft_round", "draft_prefill", "draft_step"])
def test_mtp_graph_failure_turns_drafting_off_and_no_request_is_lost(ckpt, reference, failing_kind):
    bus = EventBus(history=50000)
    executor = FailingExecutor(lambda kind, key: kind == failing_kind, nth=2,
                               error=lambda kind, key: GraphDegraded(kind, key, None, OOM))
    engine = make_engine(ckpt, bus=bus, batch=3, batch_mtp=True, mtp_depth=2, executor=executor)
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert executor.raised == 1
    assert got == reference
    assert not engine.mtp_on and "out of memory" in engine.mtp_off_reason
    assert engine.sched.draft_tokens == 0
    warnings = [w.message for w in _events(bus, "warning")]
    assert any("MTP drafting turned off" in m and "out of memory" in m for m in warnings)
    kinds_after = [kind for kind, _ in executor.seen[-6:]]
    assert not any(k.startswith("draft") or k == "verify" for k in kinds_after)
    assert engine.health().ready


def test_an_exception_in_a_step_reports_the_real_error_and_ends_every_request(ckpt):
    def error(kind, key):
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            try:
                raise RuntimeError("mtp: round capture: no error") from inner
            except RuntimeError as outer:
                return outer

    bus = EventBus(history=50000)
    executor = FailingExecutor(lambda kind, key: kind == "decode", nth=3, error=error)
    engine = make_engine(ckpt, bus=bus, batch=3, executor=executor)
    outs = run_all(engine, PROMPTS, GREEDY)
    finals = [seq[-1] for seq in outs.values()]
    assert len(finals) == len(PROMPTS) and all(o.finished for o in finals)
    assert {o.finish_reason for o in finals} == {"error"}
    assert all("illegal memory access" in (o.error or "") for o in finals)
    err = _events(bus, "error")[-1]
    # The real error, never the "no error" status the seed report's engine printed.
    assert err.fatal and "illegal memory access" in err.message and "no error" not in err.message
    health = engine.health()
    assert not health.ready and health.reason.startswith("dead:") and "illegal memory access" in health.reason


def test_an_eager_out_of_memory_gets_room_from_the_tier_and_the_step_is_retried(ckpt, reference):
    bus = EventBus(history=50000)
    executor = FailingExecutor(lambda kind, key: kind == "decode", nth=4,
                               error=lambda kind, key: RuntimeError("CUDA error: out of memory"))
    engine = make_engine(ckpt, bus=bus, batch=3, executor=executor)
    released: list[tuple[float, str]] = []

    def release(mib: float, reason: str) -> float:
        released.append((mib, reason))
        return 64.0

    engine.runner.release_memory = release
    assert tokens_of(run_all(engine, PROMPTS, GREEDY)) == reference
    assert released and "decode step out of memory" in released[0][1]
    assert any("CUDA error: out of memory" in w.message and "retrying" in w.message for w in _events(bus, "warning"))
    assert engine.health().ready
