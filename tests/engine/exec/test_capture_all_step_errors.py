"""Step errors through the classifier (engine.gpu_errors.error_event): a non-sticky failure ends only the
requests holding a slot and the engine serves on; one that repeats step after step, or a sticky one, is fatal.

(Lives next to the CAPTURE_ALL tests because it was written with them; it tests engine.Engine._fail.)
"""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.orchestration.engine import MAX_FAILED_STEPS
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of
from tests.engine.test_engine_faults import FailingExecutor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(6, seed=5, lengths=(5, 60))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _errors(bus: EventBus) -> list:
    return [e for e in bus.history() if e.type == "error"]


def test_a_non_sticky_step_error_ends_the_slotted_requests_and_the_engine_serves_on(ckpt):
    bus = EventBus(history=50000)
    executor = FailingExecutor(lambda kind, key: kind == "decode", nth=2,
                               error=lambda kind, key: ValueError(f"bad bucket {key!r} for slot 9"))
    engine = make_engine(ckpt, bus=bus, batch=3, executor=executor)
    outs = run_all(engine, PROMPTS, GREEDY)
    finals = {rid: seq[-1] for rid, seq in outs.items()}
    failed = {rid for rid, o in finals.items() if o.finish_reason == "error"}
    # The 3 slots held requests when decode failed; the 3 queued behind them kept their place and completed.
    assert len(failed) == 3
    assert all("ValueError: bad bucket" in finals[rid].error for rid in failed)
    assert all(finals[rid].finish_reason == "length" for rid in set(finals) - failed)
    (err,) = _errors(bus)
    assert not err.fatal and err.where == "engine.step" and err.exc_type == "ValueError"
    assert "slot 9" in err.message
    assert engine.health().ready
    after = tokens_of(run_all(engine, PROMPTS[:2], GREEDY, prefix="after"))
    assert all(len(toks) == GREEDY.max_tokens for toks in after.values())


def test_a_failed_step_leaves_later_outputs_exact(ckpt):
    """The slots the failure left half-written are reused without leaking into later requests."""
    reference = tokens_of(run_all(make_engine(ckpt, batch=3), PROMPTS, GREEDY, prefix="x"))
    executor = FailingExecutor(lambda kind, key: kind == "decode", nth=2,
                               error=lambda kind, key: RuntimeError("cuBLAS handle went away"))
    engine = make_engine(ckpt, batch=3, executor=executor)
    run_all(engine, PROMPTS, GREEDY)
    assert tokens_of(run_all(engine, PROMPTS, GREEDY, prefix="x")) == reference


def test_a_repeating_non_sticky_error_becomes_fatal(ckpt):
    bus = EventBus(history=50000)

    class AlwaysFailing(FailingExecutor):
        def run(self, kind, key, fn, inputs, owner=None):
            if kind == "decode":
                raise RuntimeError("the same bug every step")
            return fn(inputs)

    engine = make_engine(ckpt, bus=bus, batch=1, executor=AlwaysFailing(lambda *_: False, 0, None))
    outs = run_all(engine, PROMPTS[:MAX_FAILED_STEPS + 2], GREEDY)
    errors = _errors(bus)
    assert [e.fatal for e in errors] == [False] * (MAX_FAILED_STEPS - 1) + [True]
    assert f"{MAX_FAILED_STEPS} failed steps, no request finished in between" in errors[-1].message
    assert all(seq[-1].finish_reason == "error" for seq in outs.values())
    health = engine.health()
    assert not health.ready and "the same bug every step" in health.reason
