"""The scheduler: FIFO admission, continuous batching, abort in every state, chunked prefill under the step
budget, prefix reuse, the queue bound and validation. `run_plan` plays the runner's part: it appends one
sampled token per finished prefill and per decode, and finishes requests that hit a stop, as the engine does."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.errors import ConfigError, MaxTokensTooLarge, PromptTooLong, QueueFull, RequestRejected
from engine.core.prefix_index import PrefixIndex
from engine.core.request import Request, RequestState
from engine.core.scheduler import Scheduler, StepPlan

BT = 16  # block_tokens


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_sched(num_slots: int = 2, queue_max: int = 8, chunk: int = 64, budget: int = 128,
               context: int = 4096, capacity_blocks: int | None = 64, **kwargs: object) -> Scheduler:
    index = PrefixIndex(BT, capacity_blocks) if capacity_blocks is not None else None
    return Scheduler(num_slots, queue_max, chunk, budget, index, BT, context_tokens=context, **kwargs)


def req(request_id: str, prompt_tokens: int = 8, max_tokens: int = 4, seed: int = 0) -> Request:
    return Request(request_id, [seed * 100_000 + i for i in range(prompt_tokens)],
                   SamplingParams(max_tokens=max_tokens))


def run_plan(sched: Scheduler, plan: StepPlan, now_s: float = 0.0, end_step: bool = True) -> None:
    """Do what the runner does with the tokens: one sampled token per last chunk and per decode."""
    stepped = [chunk.request for chunk in plan.prefill if chunk.is_last] + plan.decode
    for r in stepped:
        result = r.append_output([1], now_s)
        if result.finish_reason is not None:
            sched.finish(r, result.finish_reason)
    if end_step:
        sched.end_step()


def drain(sched: Scheduler, max_steps: int = 1000) -> list[StepPlan]:
    plans = []
    while sched.has_work:
        assert len(plans) < max_steps, "the scheduler stopped making progress"
        plans.append(sched.schedule())
        run_plan(sched, plans[-1])
    return plans


# --- admission order and continuous batching -----------------------------------------------------------


def test_requests_are_admitted_in_fifo_order_to_the_lowest_free_slot() -> None:
    sched = make_sched(num_slots=2)
    for name in ("a", "b", "c", "d"):
        sched.add(req(name))
    plan = sched.schedule()
    assert [(adm.request.request_id, adm.slot) for adm in plan.admitted] == [("a", 0), ("b", 1)]
    assert [r.request_id for r in sched.waiting()] == ["c", "d"]
    assert sched.get("c").state is RequestState.WAITING


def test_a_finished_slot_takes_the_next_request_at_the_next_step() -> None:
    sched = make_sched(num_slots=2)
    sched.add(req("short", max_tokens=1))
    sched.add(req("long", max_tokens=50))
    sched.add(req("next"))
    run_plan(sched, sched.schedule())  # both prefill; "short" gets its only token and finishes
    assert sched.get("short") is None and sched.num_slots - sched.num_running == 1
    plan = sched.schedule()
    assert [(adm.request.request_id, adm.slot) for adm in plan.admitted] == [("next", 0)]
    assert [r.request_id for r in plan.decode] == ["long"]  # the running slot did not wait


def test_every_request_finishes_with_its_token_count() -> None:
    sched = make_sched(num_slots=3)
    reqs = [req(f"r{i}", prompt_tokens=10 + 30 * i, max_tokens=1 + i) for i in range(7)]
    for r in reqs:
        sched.add(r)
    drain(sched)
    assert all(r.is_finished and r.finish_reason == "length" for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [r.max_tokens for r in reqs]
    assert sched.num_slots - sched.num_running == 3 and sched.num_waiting == 0


# --- abort ---------------------------------------------------------------------------------------------


def _prime_cache(sched: Scheduler, prompt_tokens: int) -> None:
    sched.add(req("primer", prompt_tokens=prompt_tokens))
    drain(sched)


def test_abort_while_queued_leaves_the_queue() -> None:
    sched = make_sched(num_slots=1)
    sched.add(req("running"))
    sched.add(req("queued"))
    sched.schedule()
    aborted = sched.abort("queued")
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.is_finished
    assert sched.waiting() == [] and sched.get("queued") is None
    assert sched.abort("queued") is None  # gone: a second abort is a no-op


def test_abort_while_prefilling_frees_the_slot_and_the_prefix_pins() -> None:
    sched = make_sched(num_slots=1, chunk=32, budget=32)
    _prime_cache(sched, prompt_tokens=5 * BT)
    sched.add(req("long", prompt_tokens=5 * BT + 200))
    plan = sched.schedule()
    assert plan.admitted[0].cached_tokens == 5 * BT
    index = sched.prefix_index
    filling = [ref.index for fill in plan.cache_fill for ref in fill.blocks]
    assert filling == [5, 6]  # the first 32-token chunk completes blocks 5 and 6
    assert index.stats().pinned_blocks == 5 + 2
    assert sched.get("long").state is RequestState.PREFILL
    sched.abort("long")
    assert index.stats().pinned_blocks == 0
    assert sched.num_slots - sched.num_running == 1 and not sched.has_work
    sched.add(req("after"))
    assert sched.schedule().admitted[0].slot == 0


def test_abort_while_decoding_frees_the_slot() -> None:
    sched = make_sched(num_slots=1)
    sched.add(req("a", max_tokens=100))
    sched.add(req("b"))
    run_plan(sched, sched.schedule())
    run_plan(sched, sched.schedule())
    assert sched.get("a").state is RequestState.DECODE
    sched.abort("a")
    assert sched.slot_request(0) is None
    plan = sched.schedule()
    assert plan.admitted[0].request.request_id == "b" and plan.decode == []


def test_finish_is_idempotent() -> None:
    sched = make_sched()
    r = req("a")
    sched.add(r)
    sched.schedule()
    assert sched.finish(r, "stop") is True
    assert sched.finish(r, "abort") is False
    assert r.finish_reason == "stop" and sched.num_slots - sched.num_running == 2


# --- chunked prefill -----------------------------------------------------------------------------------


def test_a_long_prefill_is_chunked_between_the_decodes_of_running_slots() -> None:
    sched = make_sched(num_slots=4, chunk=64, budget=100, context=8192)
    for name in ("d0", "d1", "d2"):
        sched.add(req(name, max_tokens=1000))
    run_plan(sched, sched.schedule())
    sched.add(req("big", prompt_tokens=1000, max_tokens=2, seed=9))
    chunks = []
    while sched.get("big").state is not RequestState.DECODE:
        plan = sched.schedule()
        assert [r.request_id for r in plan.decode] == ["d0", "d1", "d2"]  # every step, no stall
        assert len(plan.prefill) == 1
        assert plan.num_tokens <= 100
        chunks.append((plan.prefill[0].start, plan.prefill[0].end))
        run_plan(sched, plan)
    assert chunks[0] == (0, 64) and chunks[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, in order
    assert all(end - start <= 64 for start, end in chunks)
    assert len(chunks) == 16  # ceil(1000 / 64)


def test_the_seed_scenario_a_fresh_176k_prompt_never_stalls_six_mtp_decodes() -> None:
    config = EngineConfig(batch=7, context=262144)  # default chunk 2048; the budget the rule's floor gives
    sched = Scheduler.from_config(config, PrefixIndex(256, 4096), 4096, draft_tokens=1)
    for i in range(6):
        sched.add(req(f"d{i}", prompt_tokens=100, max_tokens=10_000, seed=i))
    run_plan(sched, sched.schedule())
    big = req("big", prompt_tokens=176_000, max_tokens=16, seed=77)
    sched.add(big)
    steps = 0
    while big.state is not RequestState.DECODE:
        plan = sched.schedule()
        steps += 1
        assert len(plan.decode) == 6 and plan.num_tokens <= 4096
        assert plan.admitted == [] or plan.admitted[0].reuse == "fresh"
        run_plan(sched, plan)
    assert steps == -(-176_000 // 2048)  # one chunk per step: the chunk size, not the leftover budget, bounds it
    assert big.num_computed_tokens == 176_000 and big.num_output_tokens == 1


def test_decode_cost_includes_drafts_and_prefill_gets_the_rest() -> None:
    sched = make_sched(num_slots=3, chunk=64, budget=64, draft_tokens=3)
    sched.add(req("d0", max_tokens=100))
    sched.add(req("d1", max_tokens=100))
    run_plan(sched, sched.schedule())
    sched.add(req("p", prompt_tokens=500, seed=3))
    plan = sched.schedule()
    assert plan.num_decode_tokens == 2 * (1 + 3)
    assert plan.prefill[0].num_tokens == 64 - 8
    assert plan.num_tokens == 64
    sched.set_draft_tokens(0)  # MTP degraded: decodes get cheaper at once
    plan = sched.schedule()
    assert plan.num_decode_tokens == 2 and plan.prefill[0].num_tokens == 62


def test_prefill_chunks_share_the_budget_in_admission_order() -> None:
    sched = make_sched(num_slots=3, chunk=64, budget=100)
    for i, name in enumerate(("p0", "p1", "p2")):
        sched.add(req(name, prompt_tokens=200, seed=i))
    plan = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefill] == [("p0", 64), ("p1", 36)]
    assert sched.get("p1").num_computed_tokens == 36 and sched.get("p2").num_computed_tokens == 0


def test_decodes_run_even_when_they_alone_exceed_the_budget() -> None:
    sched = make_sched(num_slots=3, chunk=4, budget=4, draft_tokens=1)
    for name in ("a", "b", "c"):
        sched.add(req(name, prompt_tokens=4, max_tokens=10))
    plan = sched.schedule()
    assert len(plan.prefill) == 1  # one 4-token chunk fills the budget
    drain(sched)
    assert all(sched.get(n) is None for n in ("a", "b", "c"))


def test_the_last_chunk_samples_and_the_request_decodes_next_step() -> None:
    sched = make_sched(chunk=64, budget=64)
    sched.add(req("a", prompt_tokens=100))
    first = sched.schedule()
    assert not first.prefill[0].is_last and sched.get("a").num_computed_tokens == 64  # of its 100
    run_plan(sched, first)
    last = sched.schedule()
    assert last.prefill[0].is_last and (last.prefill[0].start, last.prefill[0].end) == (64, 100)
    assert last.decode == []
    run_plan(sched, last)
    assert [r.request_id for r in sched.schedule().decode] == ["a"]


# --- prefix reuse --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_tokens, cached_tokens", [(5 * BT + 7, 5 * BT), (5 * BT, 4 * BT), (BT, 0)])
def test_a_repeated_prompt_reuses_every_full_block_but_never_the_last_token(prompt_tokens: int,
                                                                            cached_tokens: int) -> None:
    sched = make_sched(num_slots=1)
    sched.add(req("first", prompt_tokens=prompt_tokens))
    assert sched.schedule().admitted[0].reuse == "fresh"
    drain(sched)
    again = req("again", prompt_tokens=prompt_tokens)
    sched.add(again)
    plan = sched.schedule()
    admission = plan.admitted[0]
    assert admission.cached_tokens == cached_tokens
    assert admission.reuse == ("reused" if cached_tokens else "fresh")
    assert [ref.index for ref in admission.cached_blocks] == list(range(cached_tokens // BT))
    assert (plan.prefill[0].start, plan.prefill[0].end) == (cached_tokens, prompt_tokens)
    assert again.num_cached_tokens == cached_tokens


def test_a_shared_prefix_reuses_only_the_shared_blocks() -> None:
    sched = make_sched(num_slots=1)
    sched.add(req("first", prompt_tokens=6 * BT))
    drain(sched)
    prompt = [i for i in range(6 * BT)]
    prompt[3 * BT + 2] = 999_999  # diverges inside block 3
    sched.add(Request("fork", prompt, SamplingParams(max_tokens=2)))
    assert sched.schedule().admitted[0].cached_tokens == 3 * BT


def test_cache_fill_covers_each_full_prompt_block_once_as_chunks_complete_them() -> None:
    sched = make_sched(num_slots=1, chunk=40, budget=40)
    sched.add(req("a", prompt_tokens=100))
    filled: list[int] = []
    for _ in range(3):
        plan = sched.schedule()
        for fill in plan.cache_fill:
            assert fill.slot == 0
            assert all(ref.index * BT + BT <= plan.prefill[0].end for ref in fill.blocks)  # computed by now
            filled += [ref.index for ref in fill.blocks]
        run_plan(sched, plan)
    assert filled == list(range(100 // BT))


def test_prefix_pins_last_until_copied() -> None:
    sched = make_sched(num_slots=2)
    _prime_cache(sched, prompt_tokens=3 * BT)
    sched.add(req("a", prompt_tokens=3 * BT + 1, max_tokens=10))
    sched.add(req("b", prompt_tokens=3 * BT + 1, max_tokens=10))
    plan = sched.schedule()
    assert sched.prefix_index.stats().pinned_blocks == 3  # the runner copies them during this step
    sched.release_prefix(plan.admitted[0].request)  # "a" copied; "b" still needs the same blocks
    assert sched.prefix_index.stats().pinned_blocks == 3
    sched.release_prefix(plan.admitted[1].request)
    assert sched.prefix_index.stats().pinned_blocks == 0
    sched.end_step()  # releasing twice is harmless: pins are per request, not counted down blindly
    assert sched.prefix_index.stats().pinned_blocks == 0 and sched.prefix_index.used_blocks == 3


def test_blocks_being_filled_stay_pinned_through_a_tier_shrink_until_the_next_step() -> None:
    sched = make_sched(num_slots=1, chunk=2 * BT, budget=2 * BT, capacity_blocks=4)
    sched.add(req("a", prompt_tokens=2 * BT + 1, max_tokens=1))
    plan = sched.schedule()
    fill_ids = {ref.block_id for ref in plan.cache_fill[0].blocks}
    assert _pinned(sched) == fill_ids
    result = sched.prefix_index.resize(0)  # the adaptive tier gives memory back mid-step
    assert fill_ids.isdisjoint(result.released_block_ids)
    assert result.capacity_blocks == 2
    sched.schedule()  # the engine did not call end_step: the next plan ends the step
    assert sched.prefix_index.stats().pinned_blocks == 0


def test_a_request_finishing_at_its_last_chunk_keeps_its_fill_pinned_until_the_step_ends() -> None:
    sched = make_sched(num_slots=1, chunk=2 * BT, budget=2 * BT)
    sched.add(req("a", prompt_tokens=2 * BT, max_tokens=1))
    plan = sched.schedule()
    fill_ids = {ref.block_id for ref in plan.cache_fill[0].blocks}
    assert len(fill_ids) == 2
    run_plan(sched, plan, end_step=False)  # its first token is its last: it finishes before the fill runs
    assert not sched.has_work and plan.cache_fill[0].should_fill
    assert _pinned(sched) == fill_ids  # a shrink by another chunk's forward cannot take them
    sched.end_step()
    assert sched.prefix_index.stats().pinned_blocks == 0  # idle: the tier can shrink freely
    assert len(sched.prefix_index.match(list(range(2 * BT)))) == 2  # and the filled blocks stay cached


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_request_ended_inside_a_step_loses_the_blocks_its_chunk_would_have_filled(reason: str) -> None:
    sched = make_sched(num_slots=1, chunk=2 * BT, budget=2 * BT)
    sched.add(req("a", prompt_tokens=5 * BT, max_tokens=4))
    run_plan(sched, sched.schedule())  # blocks 0, 1 filled
    plan = sched.schedule()  # plans blocks 2, 3
    sched.finish(sched.get("a"), reason)  # before the runner ran the chunk
    assert not plan.cache_fill[0].should_fill
    assert sched.prefix_index.stats().pinned_blocks == 0
    assert [ref.index for ref in sched.prefix_index.match(list(range(5 * BT)))] == [0, 1]


def test_an_abort_between_steps_keeps_what_was_filled() -> None:
    sched = make_sched(num_slots=1, chunk=2 * BT, budget=2 * BT)
    sched.add(req("a", prompt_tokens=5 * BT, max_tokens=4))
    run_plan(sched, sched.schedule())
    sched.abort("a")
    assert [ref.index for ref in sched.prefix_index.match(list(range(5 * BT)))] == [0, 1]


def test_no_prefix_index_means_every_admission_is_fresh() -> None:
    sched = make_sched(capacity_blocks=None)
    sched.add(req("a", prompt_tokens=3 * BT))
    drain(sched)
    sched.add(req("b", prompt_tokens=3 * BT))
    plan = sched.schedule()
    assert plan.admitted[0].reuse == "fresh" and plan.cache_fill == []


# --- queue bound and validation ------------------------------------------------------------------------


def test_the_queue_is_bounded_and_says_when_to_retry() -> None:
    clock = FakeClock()
    sched = make_sched(num_slots=1, queue_max=2, clock=clock)
    for name in ("a", "b"):
        sched.add(req(name))
    with pytest.raises(QueueFull) as info:
        sched.add(req("c"))
    assert (info.value.queued, info.value.limit) == (2, 2)
    assert info.value.retry_after_s == 1.0  # no finishes seen yet
    for i, name in enumerate(("a", "b")):
        sched.schedule()
        clock.now_s = 4.0 * (i + 1)
        sched.finish(sched.get(name), "stop")
    assert sched.retry_after_s() == pytest.approx(4.0)  # one finish every 4 s
    sched.add(req("c"))  # room again


def test_validation_errors_carry_the_numbers() -> None:
    sched = make_sched(context=100)
    with pytest.raises(PromptTooLong) as too_long:
        sched.add(req("a", prompt_tokens=101))
    assert (too_long.value.prompt_tokens, too_long.value.context_tokens) == (101, 100)
    with pytest.raises(MaxTokensTooLarge) as too_many:
        sched.add(req("b", prompt_tokens=90, max_tokens=11))
    err = too_many.value
    assert (err.max_tokens, err.prompt_tokens, err.context_tokens) == (11, 90, 100)
    assert "only 10 tokens are left" in str(too_many.value)
    sched.add(req("c", prompt_tokens=90, max_tokens=10))  # exactly fits
    assert sched.num_waiting == 1


@pytest.mark.parametrize("make, param", [
    (lambda: Request("e", [], SamplingParams()), "prompt"),
    (lambda: Request("z", [1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda: req("dup"), "request_id"),
])
def test_unservable_requests_are_rejected_naming_the_field(make, param: str) -> None:
    sched = make_sched()
    sched.add(req("dup"))
    with pytest.raises(RequestRejected) as info:
        sched.add(make())
    assert info.value.param == param
    assert sched.num_waiting == 1


@pytest.mark.parametrize("bad_id, vocab_size", [(-3, None), (500, 500), (2.5, None), ("x", None)])
def test_bad_token_ids_are_rejected_with_their_position(bad_id: object, vocab_size: int | None) -> None:
    sched = make_sched(vocab_size=vocab_size)
    with pytest.raises(RequestRejected, match=f"prompt token 2 is {bad_id!r}") as info:
        sched.add(Request("t", [1, 2, bad_id, 4], SamplingParams()))
    assert info.value.param == "prompt"


@pytest.mark.parametrize("kwargs, param", [
    ({"num_slots": 0}, "num_slots"),
    ({"chunk": 200, "budget": 100}, "prefill_chunk_tokens"),
    ({"context": 0}, "context_tokens"),
    ({"draft_tokens": -1}, "draft_tokens"),
])
def test_bad_scheduler_options_are_config_errors(kwargs: dict[str, int], param: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_sched(**kwargs)
    assert info.value.param == param


def test_block_tokens_must_agree_with_the_index() -> None:
    with pytest.raises(ConfigError, match="block_tokens=32"):
        Scheduler(1, 1, 8, 8, PrefixIndex(BT, 4), 32, context_tokens=64)


def test_from_config_takes_the_serve_options() -> None:
    config = EngineConfig(batch=3, queue_max=5, prefill_chunk_tokens=512, step_token_budget=1024, context=2048)
    sched = Scheduler.from_config(config, PrefixIndex(BT, 8))
    assert (sched.num_slots, sched.queue_max, sched.prefill_chunk_tokens, sched.step_token_budget,
            sched.context_tokens, sched.block_tokens) == (3, 5, 512, 1024, 2048, BT)


# --- chunks beside the steps (engine.exec.chunk_stream) ----------------------------------------------------------


def test_beside_the_steps_one_whole_chunk_is_in_flight_and_its_request_decodes_once_it_lands() -> None:
    clock = FakeClock()
    sched = make_sched(num_slots=2, chunk=64, budget=128, clock=clock)
    sched.overlap_chunks = True
    short = req("short", prompt_tokens=8, max_tokens=100)
    sched.add(short)
    run_plan(sched, sched.schedule())  # alone: its chunk runs between the steps, it decodes next step
    assert short.state is RequestState.DECODE
    long = req("long", prompt_tokens=150, seed=1)
    sched.add(long)
    plan = sched.schedule()
    (chunk,) = plan.prefill
    assert chunk.beside_decode and (chunk.start, chunk.end) == (0, 64) and plan.decode == [short]
    assert plan.cache_fill == []  # planned when the chunk lands
    run_plan(sched, plan)
    for _ in range(3):  # in flight: steps decode only
        plan = sched.schedule()
        assert plan.prefill == [] and plan.decode == [short] and sched.chunk_in_flight
        run_plan(sched, plan)
    fill = sched.chunk_landed(chunk, 0.01)
    assert fill is not None and [ref.index for ref in fill.blocks] == [0, 1, 2, 3]  # the 4 full blocks of 64
    assert not sched.chunk_in_flight
    starts = []
    while long.state is not RequestState.DECODE:
        plan = sched.schedule()
        assert long not in plan.decode, "decoding before its last chunk landed"
        for c in plan.prefill:
            starts.append(c.start)
            if c.is_last:
                assert long.state is RequestState.PREFILL and not long.num_output_tokens
            sched.chunk_landed(c, 0.01)
        run_plan(sched, plan)
    assert starts == [64, 128] and sched.schedule().decode == [short, long]


def test_an_abort_with_a_chunk_in_flight_frees_the_next_launch() -> None:
    sched = make_sched(num_slots=3, chunk=64, budget=128)
    sched.overlap_chunks = True
    short = req("short", prompt_tokens=8, max_tokens=100)
    sched.add(short)
    run_plan(sched, sched.schedule())
    first, second = req("first", prompt_tokens=200, seed=1), req("second", prompt_tokens=100, seed=2)
    sched.add(first)
    sched.add(second)
    (chunk,) = sched.schedule().prefill
    assert chunk.request is first and sched.chunk_in_flight
    sched.finish(first, "abort")
    assert not sched.chunk_in_flight
    assert sched.chunk_landed(chunk, 0.01) is None  # a late landing of the aborted request's chunk plans nothing
    (nxt,) = sched.schedule().prefill
    assert nxt.request is second and nxt.start == 0


def test_after_a_chunk_the_pacer_keeps_the_side_stream_idle_for_decode_to_keep_its_share() -> None:
    clock = FakeClock()
    sched = make_sched(num_slots=2, chunk=64, budget=128, clock=clock, prefill_step_share=0.5)
    sched.overlap_chunks = True
    from engine.core.prefill_pacer import StepTiming

    short = req("short", prompt_tokens=8, max_tokens=100)
    sched.add(short)
    run_plan(sched, sched.schedule())
    sched.record_step(StepTiming(0.002, 1))  # a decode step alone: 2 ms
    sched.add(req("long", prompt_tokens=300, seed=1))
    (chunk,) = sched.schedule().prefill
    sched.record_step(StepTiming(0.008, 1, beside_chunk=True))  # beside the chunk: 8 ms, decode kept 1/4
    # decode kept 0.25 of its rate for the chunk's 0.4 s: idle 0.4 * (0.5 - 0.25) / 0.5 = 0.2 s to average 0.5
    assert sched.pacer.beside_gap_s(0.4) == pytest.approx(0.2)
    sched.chunk_landed(chunk, 0.4)
    assert sched.schedule().prefill == []
    clock.now_s = 0.19
    assert sched.schedule().prefill == []
    clock.now_s = 0.21
    (nxt,) = sched.schedule().prefill
    assert nxt.start == 64
    sched.record_step(StepTiming(0.003, 1, beside_chunk=True))  # the mean of the steps beside chunks: 5.5 ms
    assert sched.pacer.beside_gap_s(0.4) == pytest.approx(0.4 * (0.5 - 0.002 / 0.0055) / 0.5)
    for _ in range(40):  # decode beside the chunks as fast as alone: no gap
        sched.record_step(StepTiming(0.002, 1, beside_chunk=True))
    assert sched.pacer.beside_gap_s(0.4) == 0.0


def test_the_gap_after_a_chunk_counts_the_steps_that_waited_on_it_in_full() -> None:
    """Decode's share is one of total times: beside a chunk, nine 3-ms steps and one of 50 ms (it waited while
    the chunk's blocks held every SM) took 77 ms for ten steps that take 20 ms alone, so decode kept 0.26 of its
    rate, not the 0.67 of the median step; the gap brings the average back to the target."""
    from engine.core.prefill_pacer import PrefillPacer, StepTiming

    pacer = PrefillPacer(prefill_step_share=0.5)
    pacer.record_step(StepTiming(0.002, 6))
    for seconds in [0.003] * 9 + [0.050]:
        pacer.record_step(StepTiming(seconds, 6, beside_chunk=True))
    kept = 0.002 / 0.0077
    assert pacer.beside_gap_s(0.4) == pytest.approx(0.4 * (0.5 - kept) / 0.5)
    for _ in range(200):  # a chunk's worth of steps beside later chunks as fast as alone: the slow one still counts
        pacer.record_step(StepTiming(0.002, 6, beside_chunk=True))
    assert pacer.beside_gap_s(0.4) == 0.0  # the mean over the window: 2.27 ms, decode kept 0.88


def _pinned(sched: Scheduler) -> set[int]:
    """The tier block ids pinned in the scheduler's prefix index (every id it handed out, pinned or not, is below
    its capacity)."""
    index = sched.prefix_index
    return {block_id for block_id in range(index.capacity_blocks) if index.is_pinned(block_id)}


def test_from_config_needs_a_budget_where_the_config_leaves_it_to_the_device() -> None:
    config = EngineConfig(batch=2, prefill_chunk_tokens=512, context=2048)  # no --step-token-budget
    assert config.step_token_budget is None
    assert Scheduler.from_config(config, PrefixIndex(BT, 8), 8192).step_token_budget == 8192
    with pytest.raises(ConfigError, match="step_token_budget"):
        Scheduler.from_config(config, PrefixIndex(BT, 8))
    given = EngineConfig(batch=2, prefill_chunk_tokens=512, step_token_budget=1024, context=2048)
    assert Scheduler.from_config(given, PrefixIndex(BT, 8), 8192).step_token_budget == 1024  # the option wins
