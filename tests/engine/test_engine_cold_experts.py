"""Cold experts three ways (engine/exec/experts/cold.py) through the real Engine on CPU, on the synthetic skewed
model: copy (the default), EXPERT_CPU and EXPERT_PREFETCH each give the all-resident run's greedy tokens, on the
eager path and on the captured (graph-safe) path run eagerly, and each does what it says."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.exec.experts.cold import cold_mode
from engine.switches import SwitchBoard
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

MODEL = "random:moe-synth-tiny"
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SWITCH = {"copy": {}, "cpu": {"EXPERT_CPU": True}, "prefetch": {"EXPERT_PREFETCH": True}}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=7, lengths=(12, 40))


def _run(prompts, captured: bool = False, **kw):
    with one_thread():
        engine = make_engine(MODEL, batch=3, **kw)
        cache = engine.lm.model.expert_provider
        if captured:
            cache.capturing = lambda x: True  # the graph-safe path, run eagerly: misses resolved between steps
        try:
            return tokens_of(run_all(engine, prompts, GREEDY)), cache.snapshot()
        finally:
            engine.close()


@pytest.fixture(scope="module")
def resident_tokens(prompts):
    tokens, snap = _run(prompts)
    assert snap.misses == 0 and snap.cold == "copy"
    return tokens


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("mode", ["copy", "cpu", "prefetch"])
def test_each_cold_path_gives_the_all_resident_tokens(prompts, resident_tokens, mode, captured):
    tokens, snap = _run(prompts, captured, expert_cache_mib=1, switches=SWITCH[mode])
    assert snap.cold == mode and snap.slots < snap.num_experts and snap.misses > 0
    assert tokens == resident_tokens
    if mode == "prefetch":
        assert snap.prefetched > 0  # the next layer's predicted experts were copied in ahead of it
    else:
        assert snap.prefetched == 0
    assert (snap.host_runs > 0) == (mode == "cpu")  # misses computed on the CPU only in cpu mode
    if captured and mode == "cpu":
        assert snap.replays == 0 and snap.reruns > 0  # a miss runs the step eagerly, its misses on the host


def test_prefetch_predicts_well_on_the_skewed_model(prompts):
    _, copy = _run(prompts, expert_cache_mib=1)
    _, prefetch = _run(prompts, expert_cache_mib=1, switches=SWITCH["prefetch"])
    assert prefetch.hit_rate > copy.hit_rate  # predicted experts were resident when their layer asked


def test_both_switches_on_serve_misses_on_the_cpu_and_say_why_prefetch_is_off():
    board = SwitchBoard.from_values({"EXPERT_CPU": True, "EXPERT_PREFETCH": True})
    assert cold_mode(board) == "cpu"
    state = board.states["EXPERT_PREFETCH"]
    assert not board.enabled("EXPERT_PREFETCH") and state.unavailable and "EXPERT_CPU is on" in state.reason
    assert cold_mode(SwitchBoard.from_values({})) == "copy"
    assert cold_mode(SwitchBoard.from_values({"EXPERT_PREFETCH": True})) == "prefetch"


def test_the_skewed_model_hits_the_cache_as_its_trace_predicts(prompts):
    _, snap = _run(prompts, expert_cache_mib=1)
    assert snap.lru_replay_hit_rate == snap.hit_rate  # the recorded trace replayed gives the live counts
    assert snap.hit_rate <= snap.oracle_hit_rate
    # a uniform router would hit about the resident fraction; the Zipf prior concentrates the routes
    assert snap.hit_rate > snap.slots / snap.num_experts + 0.1


def _trace_run(prompts, late: bool, monkeypatch, **kw):
    """All resident, the captured (graph-safe) path run eagerly; `late`: its counts read a step late (the
    default), else checked after every step as when an expert can miss."""
    from engine.exec.experts.cache import ExpertCache

    if not late:
        monkeypatch.setattr(ExpertCache, "counts_late_ok", lambda self: False)
    with one_thread():
        engine = make_engine(MODEL, batch=3, **kw)
        cache = engine.lm.model.expert_provider
        cache.capturing = lambda x: True
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            snap = cache.snapshot()
            cache.flush_late_counts()
            trace = [(a.step, a.layer, a.experts, a.tokens, a.kind) for a in cache.stats.trace]
            return tokens, snap, trace
        finally:
            engine.close()
            monkeypatch.undo()


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_counts_read_a_step_late_lose_nothing(prompts, resident_tokens, monkeypatch, ahead):
    """Every expert resident: a captured step's route counts are recorded while the next one runs (and a step
    may go ahead); the trace, the hits and the tokens are those of a run checked after every step."""
    checked, checked_snap, checked_trace = _trace_run(prompts, False, monkeypatch)
    tokens, snap, trace = _trace_run(prompts, True, monkeypatch, decode_ahead=ahead)
    assert tokens == checked == resident_tokens
    assert snap.misses == 0 and snap.hit_rate == 1.0
    if ahead == "off":  # a step launched ahead and dropped is counted too: the traces match without it
        assert trace == checked_trace and len(trace) > 3 * snap.num_layers
        assert snap.hits >= checked_snap.hits - 2 * snap.num_layers  # the last step may still be in flight
