"""Prefill pacing by measured cost: the chunk cost fit, and the scheduler keeping decode at its share while a
fresh long prompt is admitted. A simulated device turns each plan into deterministic timings (a known cost
function, optionally with seeded noise), which are fed back through `Scheduler.record_step` as the engine does;
the scheduler and the pacer under test are the real ones."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.api import SamplingParams
from engine.errors import ConfigError
from engine.core.chunk_cost import ChunkCost, ChunkCostModel, ChunkTiming
from engine.core.prefill_pacer import PrefillPacer, StepTiming
from engine.core.prefix_index import PrefixIndex
from engine.core.request import Request, RequestState
from engine.core.scheduler import Scheduler, StepPlan

# An H200-like 8B model: 5 ms per chunk, 40K tokens/s through the layers, attention as costly at 27K keys.
TRUE_COST = ChunkCost(fixed_s=5e-3, per_token_s=25e-6, per_token_key_s=25e-6 / 27_000)
LONG_TOKENS = 176_000


@dataclass
class SimDevice:
    """Runs a plan in simulated time: decode costs `decode_s` per step, a chunk what `cost` says, and each
    step with prefill `fill_s` more for its cache fills; `noise` scales every figure by 1 +- noise."""

    decode_s: float = 0.025
    cost: ChunkCost = TRUE_COST
    fill_s: float = 0.0
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _jitter(self, seconds: float) -> float:
        return seconds * (1 + self._rng.uniform(-self.noise, self.noise))

    def run(self, plan: StepPlan) -> StepTiming:
        decode_s = self._jitter(self.decode_s) if plan.decode else None
        chunks = [ChunkTiming(c.start, c.num_tokens, self._jitter(self.cost.predict_s(c.num_tokens, c.start)))
                  for c in plan.prefill]
        return StepTiming(decode_s, len(plan.decode), chunks, self.fill_s if chunks else 0.0)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def advance(plan: StepPlan) -> None:
    """The runner's part for tokens: one sampled token per decode and per last chunk."""
    for r in plan.decode + [c.request for c in plan.prefill if c.is_last]:
        r.append_output([1], 0.0)


@dataclass
class Admitted:
    plans: list[StepPlan]
    timings: list[StepTiming]

    @property
    def decode_s(self) -> float:
        return sum(t.decode_s or 0.0 for t in self.timings)

    @property
    def prefill_s(self) -> float:
        return sum(t.prefill_s for t in self.timings)

    @property
    def decode_ratio(self) -> float:
        """Decode rate during the admission relative to decode alone (decode tokens per step are constant)."""
        return self.decode_s / (self.decode_s + self.prefill_s)


def admit_long_prompt(device: SimDevice, decoding: int = 6, long_tokens: int = LONG_TOKENS,
                      warm_steps: int = 3, **sched_kwargs: object) -> tuple[Scheduler, Admitted]:
    """`decoding` slots decode; then a fresh `long_tokens` prompt arrives. Steps until its first token."""
    kwargs = dict(context_tokens=262_144, draft_tokens=1, block_tokens=256)
    kwargs.update(sched_kwargs)
    sched = Scheduler(decoding + 1, 16, 2048, 4096, None, **kwargs)
    for i in range(decoding):
        sched.add(Request(f"d{i}", list(range(i, i + 64)), params(100_000)))
    for _ in range(warm_steps):
        plan = sched.schedule()
        advance(plan)
        sched.record_step(device.run(plan))
    sched.add(Request("long", [7] * long_tokens, params(4)))
    plans, timings = [], []
    long = sched.get("long")
    while not long.output_token_ids:
        assert len(plans) < 20 * long_tokens, "the long prompt stopped making progress"
        plan = sched.schedule()
        advance(plan)
        timing = device.run(plan)
        sched.record_step(timing)
        plans.append(plan)
        timings.append(timing)
    return sched, Admitted(plans, timings)


# --- the cost model ------------------------------------------------------------------------------------------


def test_the_cost_fit_recovers_the_three_terms_from_measured_chunks() -> None:
    model = ChunkCostModel()
    for tokens, start in [(256, 0), (2048, 0), (1024, 40_000), (512, 90_000), (2048, 120_000), (256, 170_000),
                          (768, 150_000), (1536, 10_000)]:
        model.record(ChunkTiming(start, tokens, TRUE_COST.predict_s(tokens, start)))
    for tokens, start in [(256, 175_000), (2048, 2_000), (1024, 100_000)]:
        truth = TRUE_COST.predict_s(tokens, start)
        assert model.predict_s(tokens, start) == pytest.approx(truth, rel=0.03), (tokens, start)


def test_before_any_chunk_the_prior_predicts_and_one_chunk_rescales_it_to_the_measurement() -> None:
    prior = ChunkCost(1e-3, 1e-5, 1e-9)
    model = ChunkCostModel(prior)
    assert model.predict_s(512, 1000) == prior.predict_s(512, 1000)
    model.record(ChunkTiming(1000, 512, 0.25))
    assert model.predict_s(512, 1000) == pytest.approx(0.25, rel=1e-3)
    # Its shape is still the prior's until other chunks tell the terms apart.
    ratio = model.predict_s(256, 0) / model.predict_s(512, 1000)
    assert ratio == pytest.approx(prior.predict_s(256, 0) / prior.predict_s(512, 1000), rel=1e-3)


# A GPU-like device deep in a long prompt: each chunk also reads (and dequantizes) every key of the span once,
# whatever its size, so small chunks pay that again and again.
SPAN_READ_COST = ChunkCost(fixed_s=2e-3, per_token_s=10e-6, per_token_key_s=1e-10, per_key_s=0.3e-6)


def test_the_cost_fit_recovers_the_per_key_term_from_two_sizes_at_each_depth() -> None:
    model = ChunkCostModel()
    for start in range(0, 160_000, 16_000):
        for tokens in (256, 512, 1024):
            model.record(ChunkTiming(start, tokens, SPAN_READ_COST.predict_s(tokens, start)))
    fitted = model.coefficients()
    assert fitted.per_key_s == pytest.approx(SPAN_READ_COST.per_key_s, rel=0.05)
    for tokens, start in [(256, 170_000), (2048, 150_000)]:
        assert model.predict_s(tokens, start) == pytest.approx(SPAN_READ_COST.predict_s(tokens, start), rel=0.03)


def test_one_slow_outlier_moves_the_fit_little() -> None:
    model = ChunkCostModel()
    for i in range(16):
        start = i * 10_000
        model.record(ChunkTiming(start, 512, TRUE_COST.predict_s(512, start)))
    model.record(ChunkTiming(80_000, 512, 20 * TRUE_COST.predict_s(512, 80_000)))  # a graph capture, say
    assert model.predict_s(512, 100_000) == pytest.approx(TRUE_COST.predict_s(512, 100_000), rel=0.15)


def test_empty_or_timeless_chunks_are_ignored() -> None:
    model = ChunkCostModel()
    model.record(ChunkTiming(0, 0, 0.1))
    model.record(ChunkTiming(0, 64, 0.0))
    assert model.coefficients() is model.prior  # nothing to fit: the prior stands


# --- the scheduler under a simulated device -------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_decode_keeps_half_its_rate_while_a_fresh_176k_prompt_is_admitted(seed: int) -> None:
    _, run = admit_long_prompt(SimDevice(noise=0.2, seed=seed), prefill_step_share=0.5)
    assert all(len(p.decode) == 6 for p in run.plans)  # every slot decodes in every step
    # Measured time settles each prediction, so the share holds on average through +-20 % noise, and no
    # more than the share is given away: the prompt still gets prefill's half.
    assert 0.49 <= run.decode_ratio <= 0.52
    assert run.plans[-1].prefill[-1].is_last  # the admission completed
    # The chunks shrink as the prefix grows: the first ones are far bigger than those deep in the prompt.
    sizes = [c.num_tokens for p in run.plans for c in p.prefill]
    assert max(sizes[:5]) >= 4 * min(sizes[-20:])
    # Deep in the prompt even a 256-token chunk costs more than a decode step: some steps decode only.
    assert sum(1 for p in run.plans if not p.prefill) > 100


def test_saving_up_for_chunks_that_amortize_the_span_read_brings_the_first_token_sooner() -> None:
    """Same device, same decode share: waiting for the chunk with the lowest cost per token (the default)
    against waiting for the smallest chunk (max_chunk_stall_s=0, what the pacer did before)."""
    device = dict(decode_s=0.0066, cost=SPAN_READ_COST, noise=0.1, seed=4)
    _, smallest = admit_long_prompt(SimDevice(**device), prefill_step_share=0.5, max_chunk_stall_s=0.0)
    _, amortized = admit_long_prompt(SimDevice(**device), prefill_step_share=0.5)
    ttft_smallest_s = smallest.decode_s + smallest.prefill_s
    ttft_amortized_s = amortized.decode_s + amortized.prefill_s
    assert ttft_amortized_s < 0.5 * ttft_smallest_s
    assert amortized.decode_ratio >= 0.49 and smallest.decode_ratio >= 0.49  # decode keeps its share either way
    deep = [c for p in amortized.plans for c in p.prefill if c.start > 100_000]
    assert max(c.num_tokens for c in deep) > 256 and all(c.num_tokens >= 256 for c in deep)
    # No saved-up chunk stalls the decoding slots much longer than the cap (the prediction is +-10 % off).
    assert max(t.prefill_s for t in amortized.timings) <= 0.2 * 1.15


def test_the_default_share_keeps_a_margin_over_half() -> None:
    _, run = admit_long_prompt(SimDevice(noise=0.2, seed=3), long_tokens=60_000)
    assert 0.54 <= run.decode_ratio <= 0.57


def test_the_token_budget_alone_would_have_stalled_decode() -> None:
    """The same admission without time pacing (share 1): what the pacing is for."""
    _, run = admit_long_prompt(SimDevice(), prefill_step_share=1.0)
    assert run.decode_ratio < 0.2
    assert all(p.num_prefill_tokens == 2048 for p in run.plans[:-1])


def test_a_larger_share_gives_prefill_more_of_each_step() -> None:
    _, half = admit_long_prompt(SimDevice(), long_tokens=40_000, prefill_step_share=0.5)
    _, most = admit_long_prompt(SimDevice(), long_tokens=40_000, prefill_step_share=0.8)
    assert 0.19 <= most.decode_ratio < half.decode_ratio
    assert len(most.plans) < len(half.plans)


def test_measured_cache_fill_time_is_paid_for_too() -> None:
    _, run = admit_long_prompt(SimDevice(fill_s=0.01, noise=0.1, seed=2), long_tokens=60_000,
                               prefill_step_share=0.5)
    assert run.decode_ratio >= 0.49


def test_paced_chunks_end_on_the_granule_and_are_never_below_the_minimum() -> None:
    _, run = admit_long_prompt(SimDevice(), long_tokens=50_001, chunk_granule_tokens=512, min_chunk_tokens=1024)
    chunks = [c for p in run.plans for c in p.prefill]
    assert chunks[-1].end == 50_001
    assert all(c.end % 512 == 0 for c in chunks[:-1])
    assert all(c.num_tokens >= 1024 for c in chunks[:-1])
    assert [(a.end, b.start) for a, b in zip(chunks, chunks[1:]) if a.end != b.start] == []


def test_an_unaligned_start_realigns_to_the_granule() -> None:
    sched = Scheduler(2, 4, 2048, 4096, PrefixIndex(16, 64), context_tokens=8192, chunk_granule_tokens=256)
    shared = list(range(48))
    first = Request("first", shared + [1], params(50))
    sched.add(first)
    plan = sched.schedule()
    advance(plan)
    sched.end_step()  # fills blocks 0..2 (48 tokens) into the tier
    sched.record_step(StepTiming(None, 0, [ChunkTiming(0, 49, 0.002)]))
    for _ in range(2):  # now "first" decodes; teach the pacer a decode time
        plan = sched.schedule()
        advance(plan)
        sched.record_step(StepTiming(0.02, 1))
    sched.add(Request("second", shared + [5] * 4000, params(1)))
    chunks = []
    while not sched.get("second").output_token_ids:
        plan = sched.schedule()
        advance(plan)
        chunks += plan.prefill
        sched.record_step(SimDevice(decode_s=0.02).run(plan))
    assert chunks[0].start == 48
    assert all(c.end % 256 == 0 for c in chunks[:-1])


def test_with_no_slot_decoding_prefill_gets_the_whole_token_budget() -> None:
    sched = Scheduler(2, 4, 1024, 1024, None, context_tokens=65_536)
    sched.record_step(StepTiming(0.5, 1))  # a very slow decode was measured once: irrelevant with none decoding
    sched.add(Request("alone", [3] * 5000, params(1)))
    sizes = []
    while not sched.get("alone").output_token_ids:
        plan = sched.schedule()
        advance(plan)
        sizes.append(plan.num_prefill_tokens)
        sched.record_step(SimDevice(decode_s=0.5, cost=ChunkCost(1.0, 1.0, 1.0)).run(plan))
    assert sizes == [1024] * 4 + [5000 - 4096]


def test_a_scheduler_never_given_a_timing_plans_by_tokens() -> None:
    sched = Scheduler(3, 4, 64, 128, None, context_tokens=4096)
    sched.add(Request("d", [1] * 8, params(100)))
    advance(sched.schedule())
    sched.add(Request("p", [2] * 500, params(1)))
    plan = sched.schedule()
    assert len(plan.decode) == 1 and plan.num_prefill_tokens == 64


def test_decoding_without_a_decode_time_runs_one_minimum_chunk_per_step() -> None:
    pacer = PrefillPacer(granule_tokens=256)
    pacer.record_step(StepTiming(None, 0, [ChunkTiming(0, 2048, 0.05)]))  # armed, but no decode measured
    assert pacer.open_step(num_decoding=4, has_prefill=True)
    assert pacer.take(4096, 2048, 100_000) == 256
    assert pacer.take(0, 2048, 100_000) == 0  # a second request waits for the next step
    pacer.close_step()


def test_a_plan_that_never_ran_settles_nothing() -> None:
    pacer = PrefillPacer(granule_tokens=256)
    pacer.record_step(StepTiming(0.02, 4))
    pacer.open_step(4, True)
    pacer.take(0, 2048, 100_000)
    pacer.close_step()
    credit_s = pacer.credit_s
    pacer.open_step(4, True)  # the step failed: no record_step came for the last plan
    assert pacer.credit_s == pytest.approx(credit_s + pacer.allowance_s())
    assert pacer.allowance_s() == pytest.approx(0.02 * 0.45 / 0.55)


@pytest.mark.parametrize("kwargs, param", [
    (dict(prefill_step_share=0), "prefill_step_share"),
    (dict(prefill_step_share=1.5), "prefill_step_share"),
    (dict(prefill_step_share=True), "prefill_step_share"),
    (dict(chunk_granule_tokens=0), "granule_tokens"),
    (dict(min_chunk_tokens=-256), "min_chunk_tokens"),
])
def test_bad_pacing_options_are_config_errors(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(ConfigError) as info:
        Scheduler(2, 4, 64, 128, None, context_tokens=4096, **kwargs)
    assert info.value.param == param


def test_a_bad_cost_prior_names_the_coefficient() -> None:
    with pytest.raises(ConfigError) as info:
        ChunkCostModel(ChunkCost(1e-3, 0.0, 1e-9))
    assert info.value.param == "chunk_cost_prior.per_token_s"


def test_the_long_prompt_moves_to_decode_and_the_credit_resets() -> None:
    sched, run = admit_long_prompt(SimDevice(), long_tokens=20_000)
    assert sched.get("long").state is RequestState.DECODE
    plan = sched.schedule()
    assert len(plan.decode) == 7 and not plan.prefill
    assert sched.pacer.credit_s == 0.0


# --- a burst of short prompts ---------------------------------------------------------------------------------

# A small model on a fast device: 2 ms per chunk, 200K tokens/s through the layers.
SHORT_PROMPT_COST = ChunkCost(fixed_s=2e-3, per_token_s=5e-6, per_token_key_s=5e-6 / 30_000)
# random:0.6b on an H200: 3.5 us a prompt token (16 prompts of 1K in one step took 52-74 ms), a decode step of
# 48-128 rows 3-5 ms, and a step budget of 16K tokens (engine.core.step_budget's on such a device).
GPU_SMALL_MODEL_COST = ChunkCost(fixed_s=1e-3, per_token_s=3.5e-6, per_token_key_s=3.5e-6 / 30_000)


@dataclass
class Burst:
    plans: list[StepPlan]
    step_s: list[float]  # each step's device time: its decode, its chunks, and a chunk launched beside it

    @property
    def first_tokens_s(self) -> float:
        return sum(self.step_s)


def burst_to_first_tokens(overlap: bool, requests: int = 128, prompt_tokens: int = 1024,
                          device: SimDevice | None = None, budget_tokens: int = 4096) -> Burst:
    """`requests` prompts arrive at once, a slot each; steps until every one has its first token. With `overlap`
    the scheduler plans chunks beside the steps (engine.exec.chunk_stream), and a chunk so planned lands at the
    start of the next step, as the engine's CPU stream does. A chunk beside a step costs the step its device time
    (on a busy device the two streams share the SMs)."""
    device = device or SimDevice(decode_s=0.02, cost=SHORT_PROMPT_COST)
    clock = [0.0]
    sched = Scheduler(requests, requests, 2048, budget_tokens, None, context_tokens=2048, block_tokens=64,
                      clock=lambda: clock[0])
    sched.overlap_chunks = overlap
    reqs = [Request(f"r{i}", [i % 97 + 1] * prompt_tokens, params(256)) for i in range(requests)]
    for r in reqs:
        sched.add(r)
    plans: list[StepPlan] = []
    step_s: list[float] = []
    in_flight = None
    while any(not r.output_token_ids for r in reqs):
        assert len(plans) < 20 * requests, "the burst stopped making progress"
        landed = []
        if in_flight is not None:
            chunk, seconds = in_flight
            in_flight = None
            sched.chunk_landed(chunk, seconds)
            if chunk.is_last:
                chunk.request.append_output([1], 0.0)
            landed = [ChunkTiming(chunk.start, chunk.num_tokens, seconds)]
        plan = sched.schedule()
        between = [c for c in plan.prefill if not c.beside_decode]
        for r in plan.decode + [c.request for c in between if c.is_last]:
            r.append_output([1], 0.0)
        timing = device.run(StepPlan(decode=plan.decode, prefill=between))
        beside_s = 0.0
        for chunk in plan.prefill:
            if chunk.beside_decode:
                beside_s = device.cost.predict_s(chunk.num_tokens, chunk.start)
                in_flight = (chunk, beside_s)
        sched.record_step(StepTiming(timing.decode_s, timing.num_decode_rows, timing.prefill, timing.other_prefill_s,
                                     beside_chunk=sched.chunk_in_flight, landed=landed))
        step_s.append((timing.decode_s or 0.0) + timing.prefill_s + beside_s)
        clock[0] += step_s[-1]
        plans.append(plan)
    return Burst(plans, step_s)


@pytest.mark.parametrize("overlap", [False, True], ids=["between", "beside"])
def test_a_burst_of_short_prompts_fills_the_step_budget_instead_of_a_few_tokens_a_step(overlap: bool) -> None:
    """128 prompts of 1K tokens: 32 steps of the 4096-token budget at the least, more where a step is held to
    twice decode's 20 ms (a burst's step: 30 ms, or half of it prefill while prompts are as many as the decoding
    slots). Held to 45 % of each step next to the few slots already decoding, the prompts would take 65 steps;
    beside the steps, one request's chunk per launch and landing, 126 (far more on a GPU, where a chunk lands many
    steps after its launch)."""
    plans = burst_to_first_tokens(overlap).plans
    assert len(plans) <= 60, len(plans)
    # The decoding slots still decode in every step.
    assert all(len(p.decode) == sum(1 for q in plans[:i] for c in q.prefill if c.is_last) for i, p in
               enumerate(plans) if not overlap)
    # Past the first steps, prompts get what a step holds beside decode's 20 ms (as much again: about 2,800 tokens)
    assert sum(p.num_prefill_tokens for p in plans[2:20]) >= 18 * 2400


@pytest.mark.parametrize("requests", [128, 256])
@pytest.mark.parametrize("overlap", [False, True], ids=["between", "beside"])
def test_a_burst_on_a_fast_device_gets_its_first_tokens_in_a_second_with_decode_steps_under_50_ms(
        overlap: bool, requests: int) -> None:
    """Issue 52's burst on random:0.6b's figures: 128 (256) prompts of 1K tokens, first tokens within 1 s (2 s),
    while the slots already decoding get a token at least every 50 ms. A 1K chunk (4.6 ms) costs more than a
    decode step's share allowance (3.7 ms of a 4.5 ms step), so paced by the share alone a prompt would take
    its chunks a few hundred tokens a step, or, beside the steps, one prompt's chunk a step; by the prompts'
    equal share, 256 of them would hold each step for 70 ms."""
    device = SimDevice(decode_s=0.0045, cost=GPU_SMALL_MODEL_COST)
    burst = burst_to_first_tokens(overlap, requests=requests, device=device, budget_tokens=16384)
    assert burst.first_tokens_s <= requests / 128, (burst.first_tokens_s, len(burst.plans))
    decoding_steps_s = [s for p, s in zip(burst.plans, burst.step_s) if p.decode]
    assert max(decoding_steps_s) <= 0.05, max(decoding_steps_s)
    assert not any(c.beside_decode for p in burst.plans for c in p.prefill)  # rows of the steps' forwards


@dataclass
class SlowFirstForward(SimDevice):
    """A device whose first prompt forward also pays a one-time cost (the allocator growing into memory the tier
    gives back, a first launch): every row of that forward is measured dearer than it will ever be again."""

    once_s: float = 0.0

    def run(self, plan: StepPlan) -> StepTiming:
        timing = super().run(plan)
        if not timing.prefill or self.once_s <= 0:
            return timing
        extra_s, self.once_s = self.once_s / len(timing.prefill), 0.0
        chunks = [ChunkTiming(c.start, c.num_tokens, c.seconds + extra_s) for c in timing.prefill]
        return StepTiming(timing.decode_s, timing.num_decode_rows, chunks, timing.other_prefill_s)


@pytest.mark.parametrize("once_s", [0.3, 1.0])
def test_a_burst_whose_first_forward_was_slow_still_runs_between_the_steps(once_s: float) -> None:
    """The H200's burst of 32 prompts took 126 steps with chunks beside the steps against 34 without: the first
    shared forward, measured slow once, made a 1K chunk look dearer than a step's allowance, and each prompt then
    went beside the steps, one chunk per launch and landing. A burst runs between the steps whatever one chunk
    is predicted to cost (the pacer sizes them), so the one-time cost is paid once, not per prompt."""
    device = SlowFirstForward(decode_s=0.0045, cost=GPU_SMALL_MODEL_COST, once_s=once_s)
    burst = burst_to_first_tokens(True, requests=128, device=device, budget_tokens=16384)
    assert not any(c.beside_decode for p in burst.plans for c in p.prefill)
    assert len(burst.plans) <= 30, len(burst.plans)
    assert burst.first_tokens_s <= 1.0 + once_s, burst.first_tokens_s


def test_a_long_prompt_still_runs_beside_the_steps_once_decode_is_measured() -> None:
    """The share grows with the prompts waiting, not for one long prompt next to decoding slots."""
    clock = [0.0]
    sched = Scheduler(7, 16, 2048, 4096, None, context_tokens=262_144, block_tokens=256, clock=lambda: clock[0])
    sched.overlap_chunks = True
    for i in range(6):
        sched.add(Request(f"d{i}", list(range(i, i + 64)), params(100_000)))
    plan = sched.schedule()
    advance(plan)
    sched.record_step(SimDevice().run(plan))
    for _ in range(3):
        plan = sched.schedule()
        advance(plan)
        sched.record_step(SimDevice(decode_s=0.005).run(plan))
    sched.add(Request("long", [7] * 100_000, params(4)))
    (chunk,) = sched.schedule().prefill
    assert chunk.beside_decode and chunk.num_tokens == 2048
