"""The reducer on its own: worker news in, view state and effects out (no terminal, no engine)."""

from __future__ import annotations

from engine.telemetry import SlotEvent
from strata_tui.engine_io.messages import (EngineExited, EngineLiveness, EngineOutput, StateSnapshot, TelemetryBatch,
                                           TelemetryStatus)
from strata_tui.state.reducer import CloseClientLater, RedrawNow, Resync, reduce
from strata_tui.state.view_state import ViewState
from strata_tui.widgets.status_bar import status_text


def _launched() -> ViewState:
    view = ViewState(mode="launched")
    view.run = 2
    view.monitor.engine_state = "ready"
    return view


def test_news_of_an_earlier_run_is_dropped() -> None:
    view = _launched()
    old = TelemetryBatch([SlotEvent(slot=0, state="decode", seq=1)])
    old.run = 1
    assert reduce(view, old, 0, 0) == [] and view.monitor.slots == {}
    assert reduce(view, EngineOutput([("stdout", "old run")], run=1), 0, 0) == [] and view.log_total == 0
    now = TelemetryBatch([SlotEvent(slot=0, state="decode", seq=1)])
    now.run = 2
    reduce(view, now, 0, 0)
    assert 0 in view.monitor.slots


def test_unreachable_then_answering_clears_the_reason_and_reads_the_state_again() -> None:
    view = _launched()
    assert reduce(view, EngineLiveness(False, "ReadTimeout"), 0, 1000.0) == [RedrawNow()]
    line = status_text(view).plain
    assert "unreachable since" in line and "ReadTimeout" in line and "ready" not in line
    assert view.stale and view.resyncing
    assert reduce(view, EngineLiveness(True, "answering"), 0, 1001.0) == [Resync(), RedrawNow()]
    line = status_text(view).plain
    assert "ReadTimeout" not in line and "unreachable" not in line
    assert view.stale, "what is shown may be another engine's until its state is read"
    reduce(view, StateSnapshot({"instance_id": "x", "switches": []}), 0, 1001.1)
    assert not view.stale and view.engine_instance == "x"


def test_unreachable_since_is_when_the_probe_saw_it_not_when_a_busy_app_got_to_the_message() -> None:
    """The status's time came from when the app handled the liveness message, which on a loaded box (the suite
    beside two busy loops: 1.79 s from the stop, against the probe's 0.85 s of allowed silence) can be well after
    the probe failed: it said the engine stopped answering later than it was seen to."""
    view = _launched()
    reduce(view, EngineLiveness(False, "ReadTimeout", seen_s=999.1), 0, 1000.0)
    assert view.unreachable_since == 999.1
    reduce(view, EngineLiveness(True, "answering", seen_s=1000.5), 0, 1001.0)
    assert view.unreachable_since is None


def test_a_stop_you_asked_for_is_no_error() -> None:
    view = _launched()
    view.stopping_why, view.monitor.engine_state = "you pressed s", "stopping"
    assert reduce(view, EngineLiveness(False, "ConnectError: refused"), 0, 0) == []
    assert reduce(view, TelemetryStatus(False, "ConnectError: refused"), 0, 0) == []
    effects = reduce(view, EngineExited(0, True, None, run=2), 0, 0)
    assert effects == [CloseClientLater(2, 1.0)]
    assert view.crash is not None and view.crash.why_stopped == "you pressed s"
    reduce(view, EngineLiveness(False, "ConnectError: refused"), 0, 0)
    line = status_text(view).plain
    assert "Error" not in line and "unreachable" not in line and "engine exited" in line


def test_a_dropped_stream_leaves_the_state_stale_until_it_is_read_again() -> None:
    view = ViewState(mode="attached", attach_url="http://x")
    reduce(view, StateSnapshot({"instance_id": "a", "switches": [{"name": "SPLIT_ATTN", "enabled": True}]}), 0, 0)
    reduce(view, TelemetryStatus(True, "connected"), 0, 0)
    assert not view.stale
    reduce(view, TelemetryStatus(False, "event stream ended"), 0, 0)
    assert view.stale and view.resyncing
    reduce(view, StateSnapshot({"instance_id": "a", "switches": [{"name": "SPLIT_ATTN", "enabled": True}]}), 0, 0)
    assert not view.stale and view.monitor.switches["SPLIT_ATTN"].running is True


def test_a_narrow_status_line_keeps_the_scenarios_progress_and_drops_the_url() -> None:
    """At 100x30 the line ended in `seed:`: the URL took the room of the scenario's progress."""
    view = _launched()
    view.engine_url, view.telemetry_connected = "http://127.0.0.1:33507", True
    view.load_running, view.load_progress = "seed", "seed: short-5: first token after 31.47 s"
    narrow = status_text(view, width=98).plain
    assert "first token after 31.47 s" in narrow and "127.0.0.1" not in narrow and len(narrow) <= 98, narrow
    wide = status_text(view, width=196).plain
    assert "127.0.0.1:33507" in wide and "first token after 31.47 s" in wide


def test_another_engines_reading_takes_the_same_path_as_strata_news() -> None:
    """A vLLM / SGLang / llama.cpp endpoint's reading is folded in by the reducer, as Strata's events are (it used to
    be changed in foreign_app.py directly): its row, and the first endpoint saying the engine answers."""
    from strata_tui.adapters.view import EndpointView
    from strata_tui.engine_io.foreign import EndpointRead, empty_view

    view = ViewState(mode="attached", attach_url="http://a:8000,http://b:8000")
    view.kind, view.foreign = "vllm", empty_view("vllm", ["http://a:8000", "http://b:8000"])
    view.monitor.engine_state = "attaching"
    before = view.version
    reading = EndpointView("http://a:8000", "vllm", reachable=True, running=3.0, decode_tokens_s=420.0)
    assert reduce(view, EndpointRead(0, reading), 0, 1000.0) == []
    assert view.foreign.endpoints[0] is reading and view.monitor.engine_state == "ready" and view.version > before
    failed = EndpointView("http://a:8000", "vllm", reachable=False, error="connection refused",
                          unreachable_since=1001.0)
    reduce(view, EndpointRead(0, failed), 0, 1001.0)
    assert view.unreachable_since == 1001.0
    other_kind = EndpointView("http://b:8000", "sglang", reachable=True)  # not the kind that row was detected as
    reduce(view, EndpointRead(1, other_kind), 0, 1002.0)
    assert view.foreign.endpoints[1] is not other_kind
