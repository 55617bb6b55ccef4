"""The expert-cache view: what the monitor makes of the `experts` section of /strata/state and `expert` events."""

from __future__ import annotations

from engine.snapshot import EngineSnapshot, ExpertCacheSnapshot
from engine.telemetry import ExpertEvent, VramEvent
from strata_tui.state.expert_view import ExpertView, budget_step_mib
from strata_tui.state.monitor_state import MonitorState


def _json(slots=6, target=8, misses=40, steps=20, hits=160, layers=(0.9, 0.55, 0.8)) -> dict:
    """The `experts` section as /strata/state sends it."""
    return {"slots": slots, "target_slots": target, "mib": 3.94, "host_mib": 9.0, "expert_mib": 0.1875,
            "num_layers": 3, "num_experts": 16, "device": "cpu", "hits": hits, "misses": misses,
            "hit_rate": round(hits / (hits + misses), 4), "oracle_hit_rate": 0.91, "lru_replay_hit_rate": 0.8,
            "reruns": 2, "replays": 7, "steps": steps,
            "layers": [{"layer": i, "hits": 0, "misses": 0, "evictions": 0, "hit_rate": r}
                       for i, r in enumerate(layers)]}


def _snap(**kw) -> ExpertCacheSnapshot:
    return ExpertCacheSnapshot.from_json(_json(**kw))


def test_misses_per_step_come_from_the_counters_between_two_snapshots() -> None:
    view = ExpertView()
    view.update(_snap(misses=40, steps=20))
    assert view.misses_per_step == 2.0  # one snapshot: the run's average
    view.update(_snap(misses=46, steps=24))
    assert view.misses_per_step == 1.5  # 6 misses over the last 4 steps
    view.update(_snap(misses=46, steps=24))  # no step since: the last rate stands
    assert view.misses_per_step == 1.5


def test_worst_layers_first_and_unknown_layers_left_out() -> None:
    view = ExpertView()
    view.update(_snap(layers=(0.9, None, 0.55, 0.8)))
    assert view.worst_layers(2) == [(2, 0.55), (3, 0.8)]


def test_budget_steps_move_one_slot_per_layer_in_whole_mib() -> None:
    snap = _snap(slots=6, target=8)  # 3 layers x 0.1875 MiB = 0.5625 MiB a slot per layer
    up = budget_step_mib(snap, +1)
    assert up is not None and int(up // 0.5625) - 1 > 8  # more slots than the target
    down = budget_step_mib(snap, -1)
    assert down is not None and int(down // 0.5625) - 1 < 8
    assert budget_step_mib(_snap(target=16), +1) is None  # every expert resident already
    assert budget_step_mib(_snap(slots=1, target=1), -1) is None  # one slot per layer is the least


def test_monitor_state_shows_experts_only_for_an_moe_engine() -> None:
    state = MonitorState()
    state.apply_snapshot(EngineSnapshot.from_json({"slots": [], "experts": None}))
    assert state.experts is None
    state.apply_snapshot(EngineSnapshot.from_json({"slots": [], "experts": _json()}))
    assert state.experts is not None and state.experts.slots == 6
    state.apply(ExpertEvent(seq=5, action="shrink", mib=1.0, total_mib=2.2, slots=3, reason="expert cache set"))
    assert state.experts.slots == 3 and state.experts.mib == 2.2
    assert state.experts.last_resize.reason == "expert cache set"
    state.apply(ExpertEvent(seq=6, action="load", experts=12, mib=2.25, ms=3.0))
    assert state.experts.loads_last == 12
    state.apply(VramEvent(seq=7, device="cpu", experts_mib=2.2))
    assert state.vram["cpu"].experts_mib == 2.2
    state.forget_engine()
    assert state.experts is None


def test_the_panel_says_where_the_store_is_and_which_policy_runs() -> None:
    from strata_tui.widgets.expert_panel import expert_lines

    view = ExpertView()
    view.update(_snap())
    text = "\n".join(line.plain for line in expert_lines(view))
    assert "host 9.00 MiB" in text and "peer" not in text and "policy" not in text  # LRU, host store: as before
    view.update(ExpertCacheSnapshot.from_json({**_json(), "host_mib": 0.0, "peer_mib": 1152.0, "store_device": "cuda:1",
                                               "policy": "lfu"}))
    text = "\n".join(line.plain for line in expert_lines(view))
    assert "peer cuda:1 1152" in text and "host" not in text and "policy lfu" in text


def test_the_heat_row_keeps_every_layer_and_shows_a_shared_cell_at_its_worst() -> None:
    from strata_tui.widgets.expert_panel import heat_row

    view = ExpertView()
    rates = [0.9] * 48
    rates[0], rates[47], rates[30] = 0.5, 0.6, None
    view.update(ExpertCacheSnapshot.from_json({**_json(), "layers": [{"layer": i, "hit_rate": r}
                                                                     for i, r in enumerate(rates)]}))
    assert view.layer_heat(48) == rates  # one layer a cell when they fit
    heat = view.layer_heat(24)  # two layers a cell: the worst of the two, the first and last layers kept
    assert len(heat) == 24 and heat[0] == 0.5 and heat[-1] == 0.6 and heat[15] == 0.9
    assert all(h == 0.9 for i, h in enumerate(heat) if i not in (0, 23))
    row = heat_row(view, 48)
    assert len(row.plain) == 48 and row.plain[30] == "·" and row.plain[0] != row.plain[1]


def test_the_panel_names_a_cold_mode_other_than_copy() -> None:
    from strata_tui.widgets.expert_panel import expert_lines

    view = ExpertView()
    view.update(ExpertCacheSnapshot.from_json({**_json(), "cold": "copy"}))
    assert "cold" not in "\n".join(line.plain for line in expert_lines(view))  # the default says nothing
    view.update(ExpertCacheSnapshot.from_json({**_json(), "cold": "cpu", "host_runs": 17}))
    assert "cold cpu  on host 17" in "\n".join(line.plain for line in expert_lines(view))
    view.update(ExpertCacheSnapshot.from_json({**_json(), "cold": "prefetch", "prefetched": 40}))
    assert "cold prefetch  prefetched 40" in "\n".join(line.plain for line in expert_lines(view))
