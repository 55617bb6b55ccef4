"""The prefill ETA models growing chunk cost and counts down between events; TTFT and prompt rate after
the first token, in the slot row and the admission line."""

from __future__ import annotations

import json
from pathlib import Path

from engine.telemetry import AdmissionEvent, SlotEvent
from strata_tui.engine_io.messages import TelemetryBatch
from strata_tui.state.monitor_state import MonitorState
from strata_tui.state.prefill_eta import PrefillTrack
from strata_tui.widgets.slot_cells import admission_line
from strata_tui.widgets.slot_cells import columns_for, slot_cells
from strata_tui.widgets.slots_table import SlotsTable
from tests.tui.conftest import FIXTURES, offline_app, wait_for

PROMPT = 150_000
CHUNK = 2048
A_S, B_S = 2e-5, 4e-10  # per token, per token per position: attention makes late chunks costlier


def _chunk_end_times() -> list[tuple[float, int]]:
    """(seconds since admission, tokens with KV) after each chunk of a fresh prompt, cost a + b·position."""
    out, t, x = [], 0.0, 0
    while x < PROMPT:
        x1 = min(PROMPT, x + CHUNK)
        t += A_S * (x1 - x) + B_S / 2 * (x1 * x1 - x * x)
        out.append((t, x1))
        x = x1
    return out


def test_eta_at_halfway_is_within_a_few_percent_where_a_constant_rate_is_far_off() -> None:
    points = _chunk_end_times()
    total_s = points[-1][0]
    track = PrefillTrack("r", PROMPT, admitted_ts=1000.0)
    for t, x in points:
        if x > PROMPT / 2:
            break
        track.add(1000.0 + t, x, received_s=t)
        half_t = t
    truth_s = total_s - half_t
    eta = track.eta_s(now_received_s=half_t)
    constant_rate_s = (PROMPT - track.computed_tokens) / (track.computed_tokens / half_t)
    assert abs(eta - truth_s) / truth_s < 0.05, (eta, truth_s)
    assert abs(constant_rate_s - truth_s) / truth_s > 0.25, "the scenario must tell the two models apart"


def test_the_report_made_when_the_first_chunk_is_planned_is_not_a_cost_sample() -> None:
    state = MonitorState.for_profile({}, 0)
    state.apply(AdmissionEvent(request_id="r", slot=0, prompt_tokens=8192, ts=100.0), received_s=0.0)
    planned = SlotEvent(slot=0, state="prefill", request_id="r", prompt_tokens=8192, prefilled_tokens=2048, ts=100.0)
    state.apply(planned, received_s=0.0)  # the engine counts the planned chunk as computed: it has not run
    for i, ts in enumerate((100.5, 101.5), start=1):
        state.apply(SlotEvent(slot=0, state="prefill", request_id="r", prompt_tokens=8192,
                              prefilled_tokens=2048 * (i + 0), prefill_tok_s=4000.0, ts=ts), received_s=ts - 100)
    state.apply(SlotEvent(slot=0, state="prefill", request_id="r", prompt_tokens=8192, prefilled_tokens=4096,
                          prefill_tok_s=2700.0, ts=101.5), received_s=1.5)
    eta = state.track_of(planned).eta_s(1.5)
    assert eta is not None and eta > 1.0, eta  # 0.5 s then 1 s per chunk: the rest takes seconds, not 0


def test_eta_counts_down_between_events() -> None:
    track = PrefillTrack("r", 10_000, admitted_ts=0.0)
    track.add(1.0, 2000, received_s=50.0)
    track.add(2.0, 4000, received_s=51.0)
    first = track.eta_s(51.0)
    assert first is not None and first > 2.0
    assert abs(track.eta_s(51.5) - (first - 0.5)) < 1e-9, "counts down on the local clock"
    # an overrunning chunk stops the count at what the chunks after it take (6000..10000: 2 s), never 0
    assert abs(track.eta_s(1e6) - 2.0) < 1e-9


def test_ttft_and_prompt_rate_after_the_first_token() -> None:
    state = MonitorState.for_profile({}, 0)
    state.apply(AdmissionEvent(request_id="long", slot=6, prompt_tokens=8000, ts=100.0), received_s=0.0)
    state.apply(SlotEvent(slot=6, state="prefill", request_id="long", prompt_tokens=8000, prefilled_tokens=4000,
                          max_tokens=16, ts=102.0), received_s=2.0)
    first = SlotEvent(slot=6, state="decode", request_id="long", prompt_tokens=8000, prefilled_tokens=8000,
                      generated_tokens=1, max_tokens=16, prefill_tok_s=2000.0, ts=104.0)
    state.apply(first, received_s=4.0)
    track = state.track_of(first)
    assert track.ttft_s == 4.0 and track.prompt_tok_s == 2000.0
    cells = slot_cells(first, track, 4.0)
    assert "TTFT 4.0s @ 2,000 tok/s" in str(cells["first_token"]) and "1/16" in cells["progress"].plain
    narrow = slot_cells(first, track, 4.0, columns=columns_for(96))  # 100x30: no first-token column
    assert "first_token" not in narrow and "TTFT 4.0s" in narrow["progress"].plain
    line = admission_line(state.last_admission, track)
    assert "TTFT 4.0s @ 2,000 tok/s" in line


async def test_the_eta_on_screen_moves_every_refresh_without_new_events(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=(160, 50)) as pilot:
        app.post_message(TelemetryBatch([
            AdmissionEvent(request_id="long", slot=0, prompt_tokens=100_000, ts=10.0, seq=1),
            SlotEvent(slot=0, state="prefill", request_id="long", prompt_tokens=100_000, prefilled_tokens=10_000,
                      prefill_tok_s=5000.0, ts=12.0, seq=2),
            SlotEvent(slot=0, state="prefill", request_id="long", prompt_tokens=100_000, prefilled_tokens=20_000,
                      prefill_tok_s=4400.0, ts=14.5, seq=3)]))
        table = app.screen.query_one(SlotsTable)
        await wait_for(pilot, lambda: "0" in table.rows and "ETA" in table.get_cell("0", "progress").plain,
                       what="an ETA")
        first = table.get_cell("0", "progress").plain
        await pilot.pause(1.3)
        later = table.get_cell("0", "progress").plain
        assert first != later, (first, later)


def test_chunks_that_paid_a_one_time_cost_do_not_flatten_the_eta() -> None:
    """The engine's fit and this one share engine/prefill_cost.py: beside decoding slots the first chunks pay
    one-time costs (a kernel compiled for each new chunk size); fitted as if every chunk paid them, the back
    half was promised at a flat rate and the ETA at halfway came out a quarter short."""
    a_s, b_s, total, chunk = 4.9e-6, 6.5e-11, 180_000, 2048
    track = PrefillTrack("r", total, admitted_ts=1000.0)
    t, x, ends = 0.0, 0, []
    while x < total:
        x1 = min(total, x + chunk)
        t += 0.006 + a_s * (x1 - x) + b_s / 2 * (x1 * x1 - x * x) + (0.05 if len(ends) < 3 else 0.0)
        ends.append((x1, t))
        x = x1
    for x1, end_s in ends:
        track.add(1000.0 + end_s, x1, received_s=end_s)
        if x1 >= total // 2:
            half_s = end_s
            break
    truth_s = ends[-1][1] - half_s
    eta = track.eta_s(now_received_s=half_s)
    assert abs(eta - truth_s) / truth_s < 0.05, (eta, truth_s)


def _shown_etas(chunk_costs_s: list[float], chunk: int, first_chunk_s: float) -> tuple[list, float]:
    """Feed a MonitorState the events a CPU engine publishes for one fresh prompt in `chunk`-token chunks costing
    `chunk_costs_s` (the first one `first_chunk_s`): the admission goes out with the step that ran the first chunk,
    stamped after it, beside the chunk's report and its prompt rate. Returns what the slot row shows at four
    refreshes between reports, (local time, ETA, progress), and when the prompt was done."""
    ends, t, x = [], 0.0, 0
    for cost in [first_chunk_s, *chunk_costs_s]:
        t, x = t + cost, x + chunk
        ends.append((t, x))
    prompt = ends[-1][1]
    state = MonitorState.for_profile({}, 0)
    t0 = 1000.0
    shown = []
    for i, (t, x) in enumerate(ends[:-1]):
        events = []
        if i == 0:
            events.append(AdmissionEvent(ts=t0 + t, request_id="long", slot=0, prompt_tokens=prompt))
        events.append(SlotEvent(ts=t0 + t + 1e-4, slot=0, state="prefill", request_id="long", prompt_tokens=prompt,
                                prefilled_tokens=x, max_tokens=1, prefill_tok_s=x / t))
        state.apply_all(events, received_s=t)
        track = state.track_of(state.slots[0])
        for tick in range(4):
            now = t + tick * 0.25
            eta = track.eta_s(now)
            if eta is None:  # shown from the second chunk on: the first pays one-time costs
                assert i == 0, (x, eta)
                continue
            assert eta > 0, (x, eta)
            shown.append((now, eta, track.progress))
    return shown, ends[-1][0]


def _jumps(shown: list) -> list[float]:
    """Each change of the shown ETA between two refreshes beyond counting down, as a ratio (under 1 s: 1 s)."""
    out = []
    for (t_a, e_a, _), (t_b, e_b, _) in zip(shown, shown[1:]):
        expected, now = max(1.0, e_a - (t_b - t_a)), max(1.0, e_b)
        out.append(max(expected, now) / min(expected, now))
    return out


def test_an_8k_prompt_eta_holds_when_the_admission_is_stamped_after_the_first_chunk() -> None:
    """An 8,192-token prompt in 1,024-token chunks whose cost grows with position: counting the first chunk as free
    (its admission stamped after it) fitted the whole curve as quadratic, +131 % at halfway on a CPU engine, and
    the first ETA read 0 s before jumping to 71 s. At halfway the ETA is within 25 % of the time left."""
    costs = [A_S * 1024 + B_S / 2 * ((x + 1024) ** 2 - x * x) for x in range(0, 8192, 1024)]
    scale = 3.5 / costs[0]  # a loaded 2-core CPU's seconds
    shown, done_s = _shown_etas([c * scale for c in costs[1:]], 1024, costs[0] * scale)
    half_t, half_eta, _ = next(s for s in shown if s[2] >= 0.5)
    truth = done_s - half_t
    assert abs(half_eta - truth) / truth <= 0.25, (half_eta, truth)
    assert max(_jumps(shown)) <= 2.0


def test_the_eta_never_jumps_more_than_2x_between_refreshes_on_noisy_chunks() -> None:
    """The chunk costs a 2-core CPU measured for an 8K prompt beside four decoding slots (256-token chunks, the box
    loaded: 0.5 s to 12 s a chunk). Fitting the first three as a growing curve promised 27 minutes after 50 s;
    what is shown now never moves by more than 2x between two refreshes beyond counting down."""
    costs = [4.9, 12.2, 5.07, 4.21, 4.1, 2.82, 0.54, 0.59, 0.96, 1.69, 1.36, 4.18, 2.34, 1.06, 1.57, 1.7, 4.26, 2.96,
             3.66, 5.96, 3.95, 1.91, 2.3, 3.84, 5.25, 3.7, 6.31, 5.57, 7.93, 7.6, 6.0]
    shown, _ = _shown_etas(costs, 256, 1.69)
    assert max(_jumps(shown)) <= 2.0 + 1e-9, max(_jumps(shown))


def _recorded_curves() -> list[dict]:
    """Chunk curves benchmarks/bench_prefill_eta.py recorded on a 2-core CPU (8,192-token prompts, 1,024-token
    chunks, alone and beside four decoding slots, the box loaded by other work): each run's (tokens with KV,
    engine seconds since admission) after every chunk and its first token's stamp."""
    lines = (FIXTURES / "prefill_8k_cpu.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _replayed(run: dict, phase_s: float, refresh_s: float = 0.25) -> tuple[float, list]:
    """The events the engine published for one recorded run, fed to a MonitorState as they arrived (the admission
    with the first chunk's report, stamped after it, and the prompt rate), and what the slot row showed at every
    refresh from `phase_s` after the first report: (error at the first refresh past halfway, shown)."""
    points = [(int(x), float(t)) for x, t in run["chunks"]]
    (_, start_s), reports = points[0], points[1:]
    total, done_s = run["prompt_tokens"], run["first_token_s"]
    state, t0 = MonitorState.for_profile({}, 0), 1000.0
    shown, half_error, k = [], None, 0
    now = reports[0][1] + phase_s
    while now < done_s:
        while k < len(reports) and reports[k][1] <= now:
            x, t = reports[k]
            events = [AdmissionEvent(ts=t0 + t, request_id="long", slot=0, prompt_tokens=total)] if k == 0 else []
            events.append(SlotEvent(ts=t0 + t + 1e-4, slot=0, state="prefill", request_id="long", prompt_tokens=total,
                                    prefilled_tokens=x, max_tokens=1, prefill_tok_s=x / (t - start_s)))
            state.apply_all(events, received_s=t)
            k += 1
        track = state.track_of(state.slots[0])
        eta = track.eta_s(now)
        if eta is None:  # shown from the second chunk on: the first pays one-time costs
            assert k < 2, (now, k)
            now += refresh_s
            continue
        assert eta >= 0, (now, eta)  # 0 once the last chunk outruns its prediction
        shown.append((now, eta, track.progress))
        if half_error is None and track.progress >= 0.5:
            half_error = (eta - (done_s - now)) / (done_s - now)
        now += refresh_s
    return half_error, shown


def _pace_held(run: dict, step: float = 1.5) -> bool:
    """Whether the run's cost per token moved smoothly from chunk to chunk (never by more than `step` times between
    neighbours, the first chunk and its one-time costs left out): the box's other load did not change mid-prompt."""
    points = [(int(x), float(t)) for x, t in run["chunks"]] + [(run["prompt_tokens"], run["first_token_s"])]
    per_token = [(t1 - t0) / (x1 - x0) for (x0, t0), (x1, t1) in zip(points[1:], points[2:])]
    return all(max(a, b) / min(a, b) <= step for a, b in zip(per_token, per_token[1:]))


def test_recorded_8k_cpu_curves_never_jump_2x_and_are_right_at_halfway_where_the_pace_held() -> None:
    """Replayed at ten refresh phases each: the shown ETA never moves by more than 2x between two refreshes beyond
    counting down, on every recorded run; at halfway it is within 25 % of the time really left on every run whose
    chunks kept a steady pace (`_pace_held`; where the box's other load changed mid-prompt, as in runs whose back half
    took 2-5x the front half's trend, no estimate made at halfway can know it)."""
    runs = _recorded_curves()
    assert len(runs) >= 6 and {r["decode_slots"] for r in runs} == {0, 4}
    for run in runs:
        for phase in range(10):
            error, shown = _replayed(run, phase * 0.025)
            assert max(_jumps(shown)) <= 2.0 + 1e-9, (run["label"], phase, max(_jumps(shown)))
            if _pace_held(run):
                assert abs(error) <= 0.25, (run["label"], phase, error)


def test_a_chunk_run_in_a_lull_of_the_boxs_other_work_does_not_set_the_pace() -> None:
    """Beside four decoding slots on the loaded 2-core box some 256-token chunks ran at 0.4-1.4 ms a token between
    chunks of 4-30 ms (the other work paused): fitted, they set the slope and the ETA at halfway was 61 % and 26 %
    short on these two recorded runs. Chunks far under the fit are left out as those far over it are."""
    runs = {run["label"]: run for run in _recorded_curves()}
    for label in ("run3", "run9"):
        for phase in range(10):
            error, _ = _replayed(runs[label], phase * 0.025)
            assert abs(error) <= 0.25, (label, phase, error)


def test_a_first_chunk_that_compiled_does_not_set_the_eta_of_a_fast_prompt() -> None:
    """A fresh engine on the H200: the first 2,048-token chunk of a 180,000-token prompt took 2.4 s (kernels compiled
    for it), then 18,000 tokens went by every 0.1 s refresh. The ETA made from the first chunk alone read 3.5 minutes,
    was held at 52.6 s by the 2x-a-refresh limit while the prompt was a third done, then fell to 0.5 s in one refresh
    (52x). Replayed from what benchmarks/bench_prefill_eta.py recorded there, alone and beside four decoding slots:
    no jump past 2x, and the lone prompt's ETA within 25 % at halfway."""
    lines = (FIXTURES / "prefill_180k_h200.jsonl").read_text().splitlines()
    runs = [json.loads(line) for line in lines if line.startswith("{")]
    assert {r["decode_slots"] for r in runs} == {0, 4}
    for run in runs:
        for phase in range(10):
            error, shown = _replayed(run, phase * 0.01, refresh_s=0.1)
            assert shown and max(_jumps(shown)) <= 2.0 + 1e-9, (run["label"], phase, max(_jumps(shown)))
            if run["decode_slots"] == 0:
                assert abs(error) <= 0.25, (run["label"], phase, error)
