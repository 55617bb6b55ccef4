"""Telemetry from a real engine run: lifecycle, admissions, slot states and coalesced progress, VRAM, switches."""

from __future__ import annotations

import time

import pytest

from engine.api import SamplingParams
from engine.orchestration.engine import SLOT_EVENT_INTERVAL_S
from engine.telemetry import EventBus, event_from_json
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_run_emits_the_maps_events_with_real_numbers(ckpt):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, batch=2, batch_mtp=True, mtp_depth=2)
    start_s = time.monotonic()
    run_all(engine, random_prompts(3, seed=50, lengths=(100, 140)),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    elapsed_s = time.monotonic() - start_s
    events = bus.history()
    for e in events:  # every event survives its JSON form (what /strata/events streams)
        assert event_from_json(e.to_json()).to_json() == e.to_json()
    assert events[0].type == "engine" and events[0].state == "loading"
    admissions = [e for e in events if e.type == "admission"]
    assert [a.prompt_tokens > 0 and a.reuse == "fresh" for a in admissions] == [True] * 3
    vram = [e for e in events if e.type == "vram"]
    assert vram and vram[0].weights_mib > 0 and vram[0].kv_mib > 0 and vram[0].total_mib > 0
    slot_events = [e for e in events if e.type == "slot"]
    for rid in ("r0", "r1", "r2"):
        mine = [e for e in slot_events if e.request_id == rid]
        states = [e.state for e in mine]
        assert states[0] == "prefill" and states[-1] == "finished" and "decode" in states
        assert mine[-1].generated_tokens == 30 and mine[-1].prefilled_tokens == mine[-1].prompt_tokens
        # Coalesced: progress at most ~10 Hz per slot, plus the state changes.
        assert len(mine) <= elapsed_s / SLOT_EVENT_INTERVAL_S + 6
        decoding = [e for e in mine if e.state == "decode" and e.generated_tokens > 2]
        if decoding:
            assert decoding[-1].acceptance is not None
    assert [e.state for e in slot_events if e.request_id is None][-1] == "idle"


def test_state_snapshot_has_every_section(ckpt):
    engine = make_engine(ckpt, batch=2)
    engine.add_request("x", random_prompts(1, seed=51)[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    snap = engine.state().to_json()
    for key in ("config", "switches", "slots", "graphs", "vram", "tier", "kv", "mtp", "queue", "health"):
        assert key in snap, key
    busy = snap["slots"][0]
    assert busy["request_id"] == "x" and busy["state"] in ("prefill", "decode")
    assert snap["slots"][1]["state"] == "idle"
    assert snap["kv"]["context_tokens"] == 1024 and snap["vram"][0]["kv_mib"] > 0


def test_split_attn_toggled_live_gives_the_same_tokens(ckpt):
    prompts = random_prompts(3, seed=52, lengths=(90, 120))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = tokens_of(run_all(make_engine(ckpt, batch=3), prompts, params))
    engine = make_engine(ckpt, batch=3)
    engine.kv.split_tokens = 64  # so these short spans take the split-KV path
    engine.set_switch("SPLIT_ATTN", True)
    split = tokens_of(run_all(engine, prompts, params))
    assert split == plain


def test_fused_projections_and_pinned_staging_give_the_same_tokens(ckpt):
    prompts = random_prompts(2, seed=53)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = tokens_of(run_all(make_engine(ckpt, batch=2), prompts, params))
    switched = make_engine(ckpt, batch=2, switches={"FUSED_PROJ": True, "PINNED_STAGING": True})
    assert switched.runner.model.fused
    assert tokens_of(run_all(switched, prompts, params)) == plain


def test_kv_resident_is_implemented_and_starts_without_a_warning(ckpt):
    bus = EventBus()
    engine = make_engine(ckpt, bus=bus, batch=1, kv_resident=256)
    assert not [e.message for e in bus.history() if e.type == "warning"]
    assert engine.kv.paging is not None and engine.kv.paging.resident_tokens == 256


def test_a_peer_device_without_a_second_gpu_is_a_config_error(ckpt):
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="second CUDA device") as info:
        make_engine(ckpt, batch=1, peer_device="cuda:1")
    assert info.value.param == "peer_device"


def test_a_long_prefill_reports_progress_rate_and_eta(ckpt, monkeypatch):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, batch=1, prefill_chunk_tokens=32, step_token_budget=32)
    engine.slot_interval_s = 0.0  # every step, so this short run shows progress
    engine.add_request("long", random_prompts(1, seed=54, lengths=(400, 401))[0],
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        engine.step()
    progress = [e for e in bus.history() if e.type == "slot" and e.request_id == "long" and e.state == "prefill"]
    prefilled = [e.prefilled_tokens for e in progress]
    assert prefilled == sorted(prefilled) and len(set(prefilled)) >= 10
    final = [e for e in bus.history() if e.type == "slot" and e.request_id == "long"][-1]
    assert final.state == "finished" and final.prefilled_tokens == 400 and final.prefill_tok_s > 0
    mid = [e for e in progress if 0 < e.prefilled_tokens < 400 and e.prefill_tok_s > 0]
    assert mid and all(e.eta_s is not None and e.eta_s >= 0 for e in mid)


@pytest.mark.parametrize("batch", [4, 80])
def test_all_slots_progress_events_stay_near_a_fixed_rate_whatever_the_batch(ckpt, batch):
    """Each busy slot's progress goes out at most every SLOT_EVENT_INTERVAL_S up to FULL_RATE_SLOTS slots; past them
    the interval grows with the slots, so their events (built on the engine thread, between the steps) cost a step
    about the same at any batch: at 256 slots, 10 Hz each was 2,560 events a second. Driven by the engine's own
    clock argument: 10 s of steps every 20 ms."""
    from engine.orchestration.engine import FULL_RATE_SLOTS

    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, batch=batch, context=256, prefill_chunk_tokens=64, step_token_budget=8192)
    for i, prompt in enumerate(random_prompts(batch, seed=55, lengths=(8, 16))):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    while engine.sched.num_waiting or any(engine.sched.slot_request(s) is None for s in range(batch)):
        engine.step()
    seq = bus.history()[-1].seq
    start_s = time.monotonic() + 1.0  # past every slot's last event
    for i in range(500):
        engine._publish_progress(start_s + i * 0.02)
    progress = [e for e in bus.history() if e.seq > seq and e.type == "slot"]
    per_slot_hz = 1.0 / SLOT_EVENT_INTERVAL_S
    expected = 10.0 * per_slot_hz * min(batch, FULL_RATE_SLOTS)  # events in 10 s
    assert 0.8 * expected <= len(progress) <= 1.2 * expected + batch, (len(progress), expected)
    assert {e.slot for e in progress} == set(range(batch))  # every slot still reports


def _decoding_engine(ckpt, batch: int, short_tokens: int):
    """`batch` slots decoding (every prompt prefilled in the first step); request r0 ends after `short_tokens`
    tokens, the others run on. Progress intervals of a minute: no entry ages out on a loaded machine."""
    engine = make_engine(ckpt, batch=batch, context=256, prefill_chunk_tokens=64, step_token_budget=8192)
    engine.slot_interval_s = 60.0
    for i, prompt in enumerate(random_prompts(batch, seed=56, lengths=(8, 16))):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=short_tokens if i == 0 else 200,
                                                            temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.sched.num_running == batch and all(r.output_token_ids for r in engine.sched.running())
    return engine


@pytest.mark.parametrize("batch", [4, 80])
def test_a_snapshot_after_a_step_builds_again_the_slots_that_changed_and_past_the_full_rate_slots_only_those(
        ckpt, batch):
    """A snapshot is forced whenever a request is admitted or finishes: at 256 busy slots nearly every step, and
    building every slot's entry took most of its time (benchmarks/snapshot_publish_cost.py --busy 256). Up to
    FULL_RATE_SLOTS every entry is built at every snapshot, as before; past them an unchanged slot's entry is
    kept up to its progress interval, and a slot whose request ended is idle in the very next snapshot."""
    from engine.orchestration.engine import FULL_RATE_SLOTS

    engine = _decoding_engine(ckpt, batch, short_tokens=4)
    slot0 = next(r.slot for r in engine.sched.running() if r.request_id == "r0")
    engine.publish_snapshot(force=True)
    before = engine.snapshot.slots
    engine.step()  # one more token in every slot
    engine.publish_snapshot(force=True)
    after = engine.snapshot.slots
    busy = [s for s in range(batch) if after[s].state == "decode"]
    if batch <= FULL_RATE_SLOTS:
        assert all(after[s].generated_tokens == before[s].generated_tokens + 1 for s in busy)
    else:
        assert all(after[s] is before[s] for s in busy)  # kept: no request changed
    for _ in range(10):
        if engine.sched.slot_request(slot0) is None:
            break
        engine.step()  # the step that ends r0 publishes a snapshot itself
    assert engine.sched.slot_request(slot0) is None and engine.snapshot.slots[slot0].state == "idle"
    engine.add_request("late", [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        engine.step()
        if engine.sched.slot_request(slot0) is not None:
            break
    assert engine.snapshot.slots[slot0].request_id == "late"  # an admission is in the next snapshot at once
    engine.close()


def test_a_kept_slot_entry_is_built_again_once_as_old_as_the_slots_progress_interval(ckpt):
    from engine.orchestration.state import SlotViews

    engine = _decoding_engine(ckpt, 4, short_tokens=200)
    req = engine.sched.slot_request(1)
    views = SlotViews()
    first = views.entry(req, 1, 100.0, engine.kv, max_age_s=1.0)
    engine.step()
    assert views.entry(req, 1, 100.9, engine.kv, max_age_s=1.0) is first  # younger than 1 s: kept
    again = views.entry(req, 1, 101.0, engine.kv, max_age_s=1.0)
    assert again is not first and again.generated_tokens == first.generated_tokens + 1
    assert views.entry(req, 1, 101.0, engine.kv, max_age_s=0.0) is not again  # age 0: always built
    assert views.entry(None, 1, 101.0, engine.kv, max_age_s=1.0).state == "idle"
    engine.close()
