"""Pilot tests of the actions that drive an engine process: launch and ready, live switches (200 and 409),
live reserve, load, stop, restart, crash panel and restart from it, quit, attach. The engine here is
tests/tui/fake_engine.py: a real child process with a real HTTP server speaking the map's protocol."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from engine.telemetry import SlotEvent
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.state.monitor_state import MonitorState
from strata_tui.widgets.crash_panel import CrashPanel
from strata_tui.widgets.slots_table import SlotsTable
from tests.tui.conftest import FAKE_ENGINE, FIXTURES, create_app, fake_engine_app, screen_text, wait_for

SIZE = (160, 50)


def _log_has(app, text: str) -> bool:
    return any(text in line for _, line in app.view.log_lines)


async def test_launch_ready_telemetry_and_slots_on_screen(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        await wait_for(pilot, lambda: app.screen.query_one(SlotsTable).row_count == 8, what="slot rows")
        assert app.view.engine_url.startswith("http://127.0.0.1:")
        assert _log_has(app, "serve --model builtin:strata-tiny") and _log_has(app, "loading 60%")
        assert not any("\x1b" in str(line) for line in app.screen.query_one("#log").lines)


async def test_live_switch_applies_and_start_only_needs_restart(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        await pilot.press("1", "3")  # SPLIT_ATTN (live), CAPTURE_ALL (start only)
        split, capture = app.view.monitor.switches["SPLIT_ATTN"], app.view.monitor.switches["CAPTURE_ALL"]
        await wait_for(pilot, lambda: split.note == "applied live"
                       and capture.note == "saved for next start", what="control answers")
        assert split.running is True and capture.needs_restart
        saved = app.store.load("default").engine.switches
        assert saved == {"SPLIT_ATTN": True, "CAPTURE_ALL": True}
        assert _log_has(app, "POST /strata/switches/SPLIT_ATTN enabled=True")
        # restart applies the start-only switch from the environment
        await pilot.press("r")
        await wait_for(pilot, lambda: app.run_id == 2 and app.view.telemetry_connected, what="restart")
        await wait_for(pilot, lambda: _log_has(app, "switches=SPLIT_ATTN,FUSED_PROJ,CAPTURE_ALL"), what="env switches")


async def test_a_start_only_switch_toggled_back_says_saved_for_the_next_start(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        capture = app.view.monitor.switches["CAPTURE_ALL"]
        notes: list[str] = []
        changed = app.view.changed
        monkeypatch.setattr(app.view, "changed", lambda: (notes.append(capture.note), changed())[1])
        for wanted in (True, False):  # on (needs a restart), then back to what the engine runs
            await pilot.press("3")
            await wait_for(pilot, lambda: app.store.load("default").engine.switches.get("CAPTURE_ALL", False)
                           is wanted and capture.note == "saved for next start", what="saved")
        assert not capture.needs_restart and capture.running is False
        assert "applied live" not in notes, notes

        def line() -> str:
            return next(line for line in screen_text(app).splitlines() if "CAPTURE_ALL" in line)

        await wait_for(pilot, lambda: "saved for next start" in line(), what="the note on screen")
        assert "applied" not in line() and "restart" not in line(), line()


async def test_toggling_a_switch_this_engine_cannot_run_says_so_and_saves_the_choice(config_dir: Path,
                                                                                      monkeypatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_UNAVAILABLE", "PAGED_ATTN")
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        paged = app.view.monitor.switches["PAGED_ATTN"]
        await wait_for(pilot, lambda: paged.unavailable, what="the state snapshot")
        notes: list[str] = []  # the note at every change the screen may draw, the control answer's included
        changed = app.view.changed
        monkeypatch.setattr(app.view, "changed", lambda: (notes.append(paged.note), changed())[1])
        for saved in (False, True):
            await pilot.press("6")
            await wait_for(pilot, lambda: _log_has(app, "POST /strata/switches/PAGED_ATTN enabled=" + str(saved))
                           and paged.note != "applying live…", what="the control answer")
            assert paged.running is False and paged.unavailable, paged
            assert paged.note == "n/a here: saved, not applied", paged  # what became of the key
            assert not paged.needs_restart  # a restart would not make it run
            assert app.store.load("default").engine.switches.get("PAGED_ATTN") is saved  # the choice is kept

            def paged_line() -> str:
                return next(line for line in screen_text(app).splitlines() if "PAGED_ATTN" in line)

            await wait_for(pilot, lambda: "n/a here: saved, not applied: nee" in paged_line(),
                           what="the n/a line")
            assert "degraded" not in paged_line() and "applied live" not in paged_line(), paged_line()
        assert "applied live" not in notes, notes  # not even until the switch event came


async def test_reserve_applies_live(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        await pilot.press("right_square_bracket")
        await wait_for(pilot, lambda: app.view.reserve_note == "applied live", what="reserve answer")
        assert _log_has(app, "POST /strata/vram-reserve mib=1536")
        assert app.store.load("default").engine.vram_reserve_mib == 1536


async def test_load_action_runs_the_seed_scenario(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        assert app.controls.load_params("seed") == {"short_max_tokens": 128}
        await pilot.press("l")
        await wait_for(pilot, lambda: app.view.load_result is not None, timeout_s=60, what="scenario")
        assert "done in" in app.view.load_result and ": ok" in app.view.load_result.splitlines()[0]
        # the long prompt was fitted to the context the server reports (8192), less what it generates
        assert _log_has(app, f"POST /v1/completions prompt_tokens={8192 - 16} "), list(app.view.log_lines)[-12:]
        await wait_for(pilot, lambda: "Load result" in screen_text(app), what="the load result on screen")
        shown = screen_text(app)
        assert "e+0" not in shown and "e+1" not in shown
        # the status line and the pop-up word the hint alike
        from strata_tui.state.reducer import RESULT_HINT
        assert RESULT_HINT in app.view.status_note
        assert any(RESULT_HINT in n.message for n in app._notifications), [n.message for n in app._notifications]
        for line in app.view.load_result.splitlines()[1:]:
            assert not line.rstrip().endswith("n/a"), line  # a metric it could not measure says why
        assert app.view.monitor.last_seq > 20, "the scenario's requests must show up as slot events"


async def test_l_asks_short_generations_and_c_cancels_the_running_scenario(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    # Every slot event the app folds in, seen on its way through (a short generation's slot may be busy and free
    # again between two looks at the table on a loaded machine, so the table alone could miss it).
    seen: list[SlotEvent] = []
    apply = MonitorState.apply

    def seeing(state: MonitorState, event, received_s=None) -> None:
        if isinstance(event, SlotEvent) and event.request_id and event.max_tokens:
            seen.append(event)
        apply(state, event, received_s)

    monkeypatch.setattr(MonitorState, "apply", seeing)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        assert "Cancel load" not in screen_text(app)  # nothing to cancel
        await pilot.press("l")
        await wait_for(pilot, lambda: bool(seen), what="the short generations", timeout_s=30)
        asked = {event.max_tokens for event in seen}
        assert max(asked) <= 256, asked  # short, whatever the profile's context (8192 here)
        await wait_for(pilot, lambda: "Cancel load" in screen_text(app), what="the cancel key in the footer")
        assert app.view.load_running == "seed"
        await pilot.press("c")
        await wait_for(pilot, lambda: app.view.load_running is None, what="cancelled")
        assert "load seed cancelled" in app.view.status_note
        # Every request of the scenario is closed, so the engine aborts it (on a loaded machine the long prompt
        # may already have gone out before `c`): all slots come free, and past the scenario's 3 s delay nothing
        # new arrives and no result is reported.
        def busy() -> bool:
            return any(s.state in ("prefill", "decode") for s in app.view.monitor.slots.values())

        await wait_for(pilot, lambda: not busy(), what="every slot free after the cancel", timeout_s=30)
        await pilot.pause(5.0)
        assert app.view.load_result is None and app.view.load_running is None
        assert not busy()
        await pilot.press("l")  # and a new one may start
        await wait_for(pilot, lambda: app.view.load_running == "seed", what="a new scenario")


async def test_stop_then_restart(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        first_pid = app.process.pid
        await pilot.press("s")
        await wait_for(pilot, lambda: app.view.crash is not None, what="exit")
        assert app.view.crash.requested and app.view.monitor.engine_state == "exited"
        panel = app.screen.query_one(CrashPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="panel")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.telemetry_connected and app.view.crash is None, what="restart")
        assert app.process.pid != first_pid
        await wait_for(pilot, lambda: not panel.visible_now, what="panel hidden")


async def test_crash_shows_exit_code_real_error_and_restarts(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, mode="crash")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.crash is not None, what="crash")
        assert app.view.crash.returncode == 1 and not app.view.crash.requested
        assert "illegal memory access" in app.view.crash.error
        panel = app.screen.query_one(CrashPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="panel")
        # the class is set on the tick that shows the panel; the screen has it after the next paint
        await wait_for(pilot, lambda: all(text in screen_text(app) for text in (
            "exit code 1", "press r to restart", "illegal memory access")), what="the crash on screen")
        monkeypatch.setenv("FAKE_ENGINE_MODE", "serve")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="restarted engine")
        assert app.view.crash is None


async def test_engine_that_cannot_start_is_reported(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, mode="fail-start")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.crash is not None, what="exit")
        assert app.view.crash.returncode == 2 and "not a checkpoint directory" in app.view.crash.error


async def test_missing_engine_program_is_reported(config_dir: Path) -> None:
    app = create_app(config_dir=config_dir, engine_program=["/nonexistent/strata-engine"], sampler_factory=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.crash is not None, what="exit")
        assert "could not start" in app.view.crash.error


async def test_quit_stops_the_engine(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        process = app.process
        await pilot.press("q")  # the quit stops the engine in a worker (SIGKILL after 2 s), then exits
        deadline = time.monotonic() + 5
        while process.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    assert not process.running


@pytest.fixture
def running_engine(monkeypatch):
    env = {"FAKE_ENGINE_EVENTS": str(FIXTURES / "seed_run.jsonl"), "FAKE_ENGINE_MODE": "serve"}
    import os
    proc = subprocess.Popen([*FAKE_ENGINE, "serve"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, **env}, text=True)
    url = next(line.split(" at ")[1].strip() for line in proc.stdout if line.startswith("strata-engine: ready"))
    yield url
    proc.kill()
    proc.wait()


async def test_attach_monitors_without_launching(config_dir: Path, running_engine: str) -> None:
    ProfileStore(config_dir).save(Profile("default"))
    app = create_app(config_dir=config_dir, attach_url=running_engine, sampler_factory=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.screen.query_one(SlotsTable).row_count == 8, what="slots")
        assert app.process is None and app.view.mode == "attached"
        await pilot.press("s")
        await pilot.pause()
        assert any("did not start" in n.message for n in app._notifications)
        await pilot.press("1")
        await wait_for(pilot, lambda: app.view.monitor.switches["SPLIT_ATTN"].note == "applied live", what="live")


async def test_restart_ends_the_previous_runs_telemetry(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        monkeypatch.setenv("FAKE_ENGINE_MODE", "fail-start")  # the new run never becomes ready
        await pilot.press("r")
        await wait_for(pilot, lambda: app.run_id == 2 and app.view.crash is not None, what="second run's exit")
        await pilot.pause(1.5)
        streams = [w for w in app.workers if w.group == "telemetry" and not w.is_finished]
        assert streams == [], "the first run's event stream must end with it"
        assert "ConnectError" not in app.view.status_note


async def test_attach_to_a_strata_url_and_a_vllm_url_shows_both(config_dir: Path, running_engine: str) -> None:
    """`--attach STRATA,VLLM`: the Strata engine keeps its own panels (slots), and the endpoint table has a row for
    each URL, each read by its own kind's adapter (it used to name the vLLM URL in the title only)."""
    from tests.tui.engine_replay import replay_server, routes_for

    ProfileStore(config_dir).save(Profile("default"))
    with replay_server(routes_for("vllm")) as vllm:
        app = create_app(config_dir=config_dir, attach_url=f"{running_engine},{vllm.url}", sampler_factory=None)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.screen.query_one(SlotsTable).row_count == 8, what="Strata's slots")
            host = vllm.url.split("://")[1]
            await wait_for(pilot, lambda: "up vLLM 0.10.1.1" in screen_text(app), 15, "the vLLM row")
            text = screen_text(app)
            assert host in text and "Strata + vLLM · 2 endpoints" in text, text
            assert "up Strata" in text, text
            await pilot.press("q")
