"""The crash panel says how the engine ended; the engine log keeps following its tail; a second `l` while a
scenario runs is refused (the first one's result is not lost); a live switch says "applying live…" at once."""

from __future__ import annotations

import signal
from pathlib import Path

from strata_tui.engine_io.messages import EngineExited, EngineOutput
from strata_tui.state.view_state import CrashInfo
from strata_tui.widgets.crash_panel import how_it_ended
from strata_tui.widgets.engine_log import EngineLog
from tests.tui.conftest import fake_engine_app, offline_app, screen_text, wait_for

SIZE = (160, 48)


def test_how_the_engine_ended_reads_plainly() -> None:
    assert how_it_ended(CrashInfo(-15, None, [], True, "you pressed s")).startswith("stopped (you pressed s)")
    assert how_it_ended(CrashInfo(-int(signal.SIGKILL), None, [], False)) == "killed by SIGKILL"
    assert how_it_ended(CrashInfo(1, None, [], False)) == "exited with exit code 1"


async def test_s_reads_stopped_you_pressed_s(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        await pilot.press("s")
        await wait_for(pilot, lambda: app.view.crash is not None, what="stopped")
        await wait_for(pilot, lambda: "engine stopped (you pressed s)" in screen_text(app), what="the crash on screen")


async def test_kill_9_reads_killed_by_sigkill(config_dir: Path, monkeypatch) -> None:
    import os

    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        os.kill(app.process.pid, signal.SIGKILL)
        await wait_for(pilot, lambda: app.view.crash is not None, what="exit")
        # drawn once the app has handled the exit: a fixed 0.4 s pause missed it once on a loaded two-core machine
        await wait_for(pilot, lambda: "engine killed by SIGKILL" in screen_text(app), what="the crash on screen")


def _at_tail(log: EngineLog) -> bool:
    return log.scroll_y >= log.max_scroll_y - 1


async def test_the_log_keeps_following_its_tail_after_a_crash(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(EngineOutput([("stdout", f"line {i}") for i in range(200)]))
        log = app.screen.query_one(EngineLog)
        await wait_for(pilot, lambda: log.lines_written == 200, what="the first lines")
        app.post_message(EngineExited(1, False, None, app.run_id))
        app.post_message(EngineOutput([("stderr", f"after {i}") for i in range(50)]))
        # the log scrolls after the screen's next refresh, which a loaded machine can put off for a while
        await wait_for(pilot, lambda: _at_tail(log) and "after 49" in screen_text(app), what="the log at its tail")


async def test_the_crash_panel_appearing_does_not_hide_the_last_lines(config_dir: Path) -> None:
    """The engine's last lines (its traceback) come before its exit; the crash panel then takes rows from the log,
    which must still show its tail, not the lines above it."""
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(EngineOutput([("stderr", f"trace {i}") for i in range(250)]))
        log = app.screen.query_one(EngineLog)
        await wait_for(pilot, lambda: log.lines_written == 250 and _at_tail(log), what="the lines, at the tail")
        height = log.size.height
        app.post_message(EngineExited(1, False, None, app.run_id))
        await wait_for(pilot, lambda: log.size.height < height, what="the crash panel taking rows from the log")
        await wait_for(pilot, lambda: _at_tail(log) and "trace 249" in screen_text(app), timeout_s=5,
                       what="the last line still in view")


async def test_l_while_a_scenario_runs_is_refused_and_the_first_result_arrives(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        await pilot.press("l")
        await wait_for(pilot, lambda: app.view.load_running == "seed", what="scenario running")
        app.controls.run_load()  # what a second `l` runs, with no await in between: the first is still running
        assert "still running" in app.view.status_note and app.view.load_running == "seed"  # refused, said so
        await wait_for(pilot, lambda: "still running" in screen_text(app), timeout_s=3, what="the refusal on screen")
        await wait_for(pilot, lambda: app.view.load_result is not None, timeout_s=60, what="the first result")
        assert "load seed done" in app.view.load_result


async def test_a_live_switch_says_applying_live_at_once_and_never_restart(config_dir: Path, monkeypatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        split = app.view.monitor.switches["SPLIT_ATTN"]
        app.controls.toggle_switch(1)  # what key 1 runs; the note changes before any I/O is started
        assert split.note == "applying live…"
        await pilot.pause(0.3)
        app.screen.redraw(force=True)
        await wait_for(pilot, lambda: split.note == "applied live", what="confirmed")
        line = [l for l in screen_text(app).splitlines() if "SPLIT_ATTN" in l][0]
        assert "restart" not in line, line
