"""Request state: derived counters, output appending with stop rules, draft statistics, timing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import SamplingParams
from engine.core.request import Request, RequestState


def _req(prompt_tokens: int = 10, **params: object) -> Request:
    return Request("r", list(range(prompt_tokens)), SamplingParams(**params), arrival_s=100.0)


def test_new_request_is_waiting_with_nothing_computed() -> None:
    req = _req(10)
    assert req.state is RequestState.WAITING
    assert req.slot is None
    assert req.num_prompt_tokens == 10
    assert req.num_computed_tokens == 0
    assert req.remaining_prompt_tokens == 10
    assert not req.is_finished and not req.is_prefill_done and req.num_cached_tokens == 0
    assert req.finish_reason is None
    assert req.first_token_s is None and req.queued_s is None


def test_computed_tokens_are_cached_plus_prefilled() -> None:
    req = _req(100)
    req.num_cached_tokens = 64
    req.num_prefilled_tokens = 20
    assert req.num_computed_tokens == 84
    assert req.remaining_prompt_tokens == 16
    req.num_prefilled_tokens = 36
    assert req.is_prefill_done and req.remaining_prompt_tokens == 0


def test_append_output_counts_tokens_and_stamps_first_token_once() -> None:
    req = _req(5, max_tokens=10)
    result = req.append_output([7, 8], now_s=101.0)
    assert result.kept_token_ids == [7, 8] and result.finish_reason is None
    req.append_output([9], now_s=102.0)
    assert req.output_token_ids == [7, 8, 9]
    assert req.num_output_tokens == 3 and req.num_tokens == 8
    assert req.first_token_s == 101.0


def test_append_output_stops_at_max_tokens_and_drops_the_excess() -> None:
    req = _req(5, max_tokens=3)
    result = req.append_output([1, 2, 3, 4, 5], now_s=1.0)  # e.g. accepted MTP drafts overshoot
    assert result.kept_token_ids == [1, 2, 3]
    assert result.finish_reason == "length"
    assert req.output_token_ids == [1, 2, 3]


def test_append_output_keeps_the_stop_token_and_drops_what_follows() -> None:
    req = _req(5, max_tokens=10, stop_token_ids=(42,))
    result = req.append_output([1, 42, 3], now_s=1.0)
    assert result.kept_token_ids == [1, 42]
    assert result.finish_reason == "stop"


def test_eos_stops_unless_ignore_eos() -> None:
    stopped = _req(5, max_tokens=10).append_output([1, 2, 0, 4], now_s=1.0, eos_token_ids=(0,))
    assert stopped.finish_reason == "stop" and stopped.kept_token_ids == [1, 2, 0]
    ignored = _req(5, max_tokens=10, ignore_eos=True).append_output([1, 0, 4], now_s=1.0, eos_token_ids=(0,))
    assert ignored.finish_reason is None and ignored.kept_token_ids == [1, 0, 4]


def test_append_to_a_finished_request_names_it() -> None:
    req = _req(5)
    req.state = RequestState.FINISHED
    req.finish_reason = "abort"
    with pytest.raises(ValueError, match="'r' is finished \\(abort\\)"):
        req.append_output([1], now_s=1.0)


def test_prefill_eta_follows_the_rate_so_far() -> None:
    req = _req(1000)
    req.admitted_s = 10.0
    req.num_prefilled_tokens = 500  # planned: 250 of them are still running
    req.chunk_ran(250, now_s=15.0)
    assert req.prefill_eta_s(now_s=15.0) == pytest.approx(750 / 50.0)  # one chunk: its rate


def test_prefill_eta_grows_with_position_from_the_second_chunk() -> None:
    """Each token costs a + b·p (attention over the keys before it): the ETA at halfway integrates that, where the
    rate so far would promise the back half at the front half's speed."""
    a_s, b_s, total, chunk = 1e-3, 2e-7, 16384, 1024

    def cost_s(x0: int, x1: int) -> float:
        return a_s * (x1 - x0) + b_s / 2 * (x1 * x1 - x0 * x0)

    req = _req(total)
    req.admitted_s = now_s = 100.0
    for x in range(0, total // 2, chunk):
        req.num_prefilled_tokens = x + chunk
        now_s += cost_s(x, x + chunk)
        req.chunk_ran(chunk, now_s=now_s)
        if x == chunk:  # the second chunk: the estimate already bends upwards
            assert req.prefill_eta_s(now_s) == pytest.approx(cost_s(2 * chunk, total), rel=0.02)
    truth_s = cost_s(total // 2, total)
    assert req.prefill_eta_s(now_s) == pytest.approx(truth_s, rel=0.02)
    constant_rate_s = (total // 2) / ((total // 2) / (now_s - 100.0))
    assert abs(constant_rate_s - truth_s) / truth_s > 0.3  # what the old estimate said
    assert req.prefill_eta_s(now_s + 1.0) == pytest.approx(truth_s - 1.0, rel=0.02)  # counts down between chunks


def test_draft_statistics_are_per_position() -> None:
    req = _req(5)
    assert req.acceptance is None and req.acceptance_at(0) is None
    req.record_drafts(proposed=3, accepted=1)
    req.record_drafts(proposed=3, accepted=3)
    req.record_drafts(proposed=2, accepted=0)
    assert req.draft_proposed == [3, 3, 2]
    assert req.draft_accepted == [2, 1, 1]
    assert req.acceptance_at(0) == pytest.approx(2 / 3)
    assert req.acceptance_at(2) == pytest.approx(1 / 2)
    assert req.acceptance_at(5) is None
    assert req.acceptance == pytest.approx(4 / 8)


@pytest.mark.parametrize("proposed, accepted", [(2, 3), (2, -1)])
def test_record_drafts_rejects_impossible_counts(proposed: int, accepted: int) -> None:
    with pytest.raises(ValueError, match=f"accepted={accepted}, proposed={proposed}"):
        _req(5).record_drafts(proposed, accepted)


def test_rates_come_from_the_timestamps() -> None:
    req = _req(1000, max_tokens=100)
    req.num_cached_tokens = 200
    req.num_prefilled_tokens = 800
    req.admitted_s = 101.0
    assert req.prefill_tok_s(now_s=103.0) is None  # planned but no chunk has run yet: no rate
    req.chunk_ran(800, now_s=103.0)
    assert req.queued_s == pytest.approx(1.0)
    assert req.prefill_tok_s() is None and req.prefill_tok_s(now_s=101.0) is None  # no time has passed
    assert req.prefill_tok_s(now_s=103.0) == pytest.approx(800 / 2.0)  # cached tokens are not counted
    assert req.prefill_eta_s(now_s=103.0) == 0.0  # all 1000 computed
    req.append_output([1], now_s=103.0)
    assert req.prefill_tok_s(now_s=500.0) == pytest.approx(800 / 2.0)  # frozen at the first token
    assert req.decode_tok_s(now_s=103.0) is None
    req.append_output([2, 3, 4, 5], now_s=104.0)
    assert req.decode_tok_s(now_s=105.0) == pytest.approx(4 / 2.0)
    req.finished_s = 107.0
    assert req.decode_tok_s(now_s=999.0) == pytest.approx(4 / 4.0)  # a finished request's rate is frozen


def test_the_serving_core_imports_no_torch() -> None:
    code = "import sys, engine.core.request, engine.core.scheduler, engine.core.prefix_index; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "False"


def test_prefill_eta_leaves_out_chunks_that_paid_a_one_time_cost() -> None:
    """Beside decoding slots the first chunks pay one-time costs (a kernel compiled or a graph captured for each
    new chunk size, the wait before the first chunk): fitted as if every chunk paid them, the back half was
    promised at a flat rate and the ETA at halfway came out a quarter short."""
    a_s, b_s, total, chunk = 4.9e-6, 6.5e-11, 180_000, 2048
    beside_s, once_s = 0.006, 0.05  # decode steps between the chunks; a new size's compile, the first three

    def cost_s(x0: int, x1: int) -> float:
        return beside_s + a_s * (x1 - x0) + b_s / 2 * (x1 * x1 - x0 * x0)

    req = _req(total)
    req.admitted_s = now_s = 100.0
    ends = []
    for i, x in enumerate(range(0, total, chunk)):
        x1 = min(total, x + chunk)
        now_s += cost_s(x, x1) + (once_s if i < 3 else 0.0)
        ends.append((x1, now_s))
    half = next(k for k, (x, _) in enumerate(ends) if x >= total // 2)
    for x1, end_s in ends[:half + 1]:
        req.num_prefilled_tokens = x1
        req.chunk_ran(x1 - (req.num_prefill_ran_tokens or 0), now_s=end_s)
    truth_s = ends[-1][1] - ends[half][1]
    assert req.prefill_eta_s(ends[half][1]) == pytest.approx(truth_s, rel=0.05)
