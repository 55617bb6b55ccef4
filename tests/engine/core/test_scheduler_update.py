"""`Scheduler.update`: what an executed plan produced, into the requests (the bookkeeping the engine did itself
before the step was three calls). The results are the contract's typed StepResult (engine.step)."""

from __future__ import annotations

from engine.api import SamplingParams
from engine.core.prefix_index import PrefixIndex
from engine.core.request import Request, RequestState
from engine.core.scheduler import Scheduler
from engine.step import RequestFailure, SampledTokens, StepResult

BT = 16
EOS = 7


def _sched() -> Scheduler:
    return Scheduler(2, 8, 64, 128, PrefixIndex(BT, 64), BT, context_tokens=4096, eos_token_ids=(EOS,))


def _last_chunk_result(plan, token: int) -> StepResult:
    chunk = plan.prefill[0]
    return StepResult(tokens=[SampledTokens(chunk.request, [token], 1.0, prefilled_tokens=chunk.num_tokens,
                                            first_token=True)], timed=True, decode_s=None,
                      chunks_s=[(chunk.start, chunk.num_tokens, 0.01)])


def test_a_first_token_is_kept_and_the_request_decodes_next() -> None:
    sched = _sched()
    r = Request("a", list(range(100, 120)), SamplingParams(max_tokens=4))
    sched.add(r)
    plan = sched.schedule()
    (out,) = sched.update(plan, _last_chunk_result(plan, 5))
    assert (out.request, out.slot, out.token_ids, out.finish_reason, out.first_token) == (r, 0, [5], None, True)
    assert r.num_prefill_ran_tokens == 20 and r.output_token_ids == [5] and r.state is RequestState.DECODE
    assert sched.schedule().decode == [r]


def test_a_stop_token_or_max_tokens_finishes_the_request_and_names_the_slot_it_held() -> None:
    sched = _sched()
    eos, short = (Request(i, list(range(n, n + 20)), SamplingParams(max_tokens=m))
                  for i, n, m in (("eos", 100, 8), ("short", 200, 2)))
    sched.add(eos)
    sched.add(short)
    plan = sched.schedule()
    result = StepResult(tokens=[SampledTokens(c.request, [3], 1.0, prefilled_tokens=c.num_tokens, first_token=True)
                                for c in plan.prefill])
    sched.update(plan, result)
    plan = sched.schedule()
    assert plan.decode == [eos, short]
    outs = sched.update(plan, StepResult(tokens=[SampledTokens(eos, [EOS, 9], 2.0), SampledTokens(short, [4], 2.0)]))
    assert [(o.request.request_id, o.slot, o.token_ids, o.finish_reason) for o in outs] == [
        ("eos", 0, [EOS], "stop"), ("short", 1, [4], "length")]
    assert eos.is_finished and short.is_finished and sched.num_running == 0 and not sched.has_work


def test_a_request_whose_part_failed_ends_with_its_error_and_the_others_keep_their_tokens() -> None:
    sched = _sched()
    bad, good = Request("bad", list(range(20)), SamplingParams()), Request("good", list(range(50, 70)), SamplingParams())
    sched.add(bad)
    sched.add(good)
    plan = sched.schedule()
    result = StepResult(tokens=[SampledTokens(good, [3], 1.0, prefilled_tokens=20, first_token=True),
                                SampledTokens(bad, [4], 1.0, prefilled_tokens=20, first_token=True)],
                        failed=[RequestFailure(bad, "boom")])
    outs = sched.update(plan, result)
    assert [(o.request.request_id, o.token_ids, o.finish_reason, o.error) for o in outs] == [
        ("good", [3], None, None), ("bad", [], "error", "boom")]
    assert bad.finish_reason == "error" and bad.output_token_ids == [] and good.output_token_ids == [3]


def test_mtp_turned_off_during_the_step_costs_no_drafts_from_the_next_plan() -> None:
    sched = Scheduler(2, 8, 64, 128, context_tokens=4096, draft_tokens=3)
    sched.add(Request("a", list(range(20)), SamplingParams()))
    plan = sched.schedule()
    sched.update(plan, StepResult(draft_tokens=0))
    assert sched.draft_tokens == 0 and sched.schedule().draft_tokens == 0
