"""MonitorState folds recorded telemetry into what the monitor shows."""

from __future__ import annotations

from engine.snapshot import EngineSnapshot
from engine.telemetry import GraphEvent, SlotEvent, SwitchEvent
from strata_tui.state.monitor_state import MonitorState, graph_severity
from tests.tui.conftest import recorded


def test_seed_run_builds_slots_vram_graphs_and_degraded_switch() -> None:
    state = MonitorState.for_profile({"SPLIT_ATTN": True}, 1024)
    events = recorded("seed_run.jsonl")
    state.apply_all(events)
    assert state.last_seq == events[-1].seq and state.engine_state == "ready"
    assert sorted(state.slots) == list(range(8))
    long = state.slots[6]
    assert long.state == "prefill" and long.prompt_tokens == 150000 and long.eta_s is not None
    assert state.vram["cuda:0"].tier_mib == 101808
    actions = [e.action for e in state.graph_events]
    assert {"capture", "fail", "evict", "retry", "wait", "degrade"} <= set(actions)
    split = state.switches["SPLIT_ATTN"]
    assert split.degraded and "out of memory" in split.reason and split.running is False
    assert state.last_admission.reuse == "fresh"


def test_graph_severity() -> None:
    """What the graph events table filters by (tests/tui/test_app_offline.py cycles the filter)."""
    assert graph_severity(GraphEvent(action="capture")) == 0
    assert graph_severity(GraphEvent(action="capture", error="boom")) == 1
    assert graph_severity(GraphEvent(action="degrade")) == 2
    state = MonitorState()
    state.apply_all(recorded("seed_run.jsonl"))
    assert {graph_severity(e) for e in state.graph_events} == {0, 1, 2}


def test_crash_run_keeps_the_real_error() -> None:
    state = MonitorState()
    state.apply_all(recorded("crash_run.jsonl"))
    assert state.last_error.fatal and "illegal memory access" in state.last_error.message
    assert state.engine_state == "exit" and state.exit_code == 1


def test_needs_restart_when_running_differs_from_profile() -> None:
    state = MonitorState.for_profile({"FUSED_PROJ": True}, 1024)
    view = state.switches["FUSED_PROJ"]
    assert not view.needs_restart  # the engine has not said yet
    state.apply(SwitchEvent(name="FUSED_PROJ", state="off", seq=1))
    assert view.needs_restart


def test_snapshot_seeds_switches_slots_vram_and_reserve() -> None:
    state = MonitorState.for_profile({}, 1024)
    state.apply_snapshot(EngineSnapshot.from_json({
        "switches": [{"name": "SPLIT_ATTN", "enabled": False, "degraded": True, "reason": "oom"}],
        "slots": [SlotEvent(slot=2, state="decode", request_id="r").to_json()],
        "vram": [{"device": "cuda:0", "total_mib": 100.0, "reserve_mib": 512.0}],
        "unknown": 1,
    }))
    assert state.switches["SPLIT_ATTN"].degraded and state.slots[2].request_id == "r"
    assert state.vram["cuda:0"].total_mib == 100.0 and state.vram_reserve_mib == 512


def test_reset_for_launch_forgets_the_old_run() -> None:
    state = MonitorState.for_profile({"SPLIT_ATTN": True}, 1024)
    state.apply_all(recorded("crash_run.jsonl"))
    state.reset_for_launch()
    assert not state.slots and state.last_error is None and state.engine_state == "starting"
    assert state.switches["SPLIT_ATTN"].wanted and state.switches["SPLIT_ATTN"].running is None
