"""Truth about an attached engine: when it stops answering the status says so within a second and what it
said is shown stale; after a reconnect everything is read again from /strata/state."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from strata_tui.state.view_state import ViewState
from strata_tui.widgets.slots_table import SlotsTable
from strata_tui.widgets.switches_panel import SwitchesPanel
from tests.tui.conftest import FAKE_ENGINE, FIXTURES, offline_app, screen_text, wait_for

SIZE = (160, 48)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_fake(port: int, events: str | None = "seed_run.jsonl", reserve_mib: int = 1024) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "FAKE_ENGINE"))}
    if events:
        env["FAKE_ENGINE_EVENTS"] = str(FIXTURES / events)
    proc = subprocess.Popen([*FAKE_ENGINE, "serve", "--port", str(port), "--vram-reserve-mib", str(reserve_mib)],
                            stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if "ready at" in line:
            return proc, line.split()[-1]
    raise AssertionError("the fake engine never got ready")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


async def test_a_stopped_engine_reads_unreachable_within_1_s_and_its_numbers_stale(config_dir: Path) -> None:
    proc, url = _start_fake(_free_port())
    try:
        app = offline_app(config_dir, attach_url=url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.telemetry_connected and app.view.monitor.slots, what="telemetry")
            await pilot.pause(0.5)
            os.kill(proc.pid, signal.SIGSTOP)  # the process is there, its sockets open, but it answers nothing
            stopped = time.time()
            await wait_for(pilot, lambda: "unreachable since" in screen_text(app), timeout_s=3, what="unreachable")
            # From the stop to the moment the app marked the engine unreachable (the status bar shows it in that
            # refresh): the test's own polling of the screen is not counted against the app on a busy runner.
            assert app.view.unreachable_since is not None
            took_s = app.view.unreachable_since - stopped
            assert took_s <= 1.0, f"took {took_s:.2f} s to say the engine is unreachable"
            assert app.screen.query_one(SlotsTable).has_class("-stale")
            assert app.screen.query_one(SwitchesPanel).has_class("-stale")
            os.kill(proc.pid, signal.SIGCONT)
            await wait_for(pilot, lambda: "unreachable" not in screen_text(app), timeout_s=3, what="answering again")
            # Answering again, it may be another engine: stale until its state is read (at once, not after the
            # stream's back-off).
            await wait_for(pilot, lambda: not app.screen.query_one(SlotsTable).has_class("-stale"), timeout_s=3,
                           what="the state read again")
            assert app.view.engine_instance is not None and not app.view.resyncing
    finally:
        _stop(proc)


async def test_after_a_reconnect_switches_reserve_and_slots_are_read_again(config_dir: Path) -> None:
    port = _free_port()
    first, url = _start_fake(port, events=None)
    second = None
    try:
        app = offline_app(config_dir, attach_url=url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
            split = app.view.monitor.switches["SPLIT_ATTN"]
            await pilot.press("1", "right_square_bracket")
            await wait_for(pilot, lambda: split.note == "applied live" and app.view.reserve_note == "applied live",
                           what="live changes")
            assert app.view.monitor.vram_reserve_mib == 1536 and split.running is True
            first.kill()
            first.wait()
            second, _ = _start_fake(port, events=None, reserve_mib=1024)  # another engine, same address
            await wait_for(pilot, lambda: app.view.monitor.vram_reserve_mib == 1024 and split.running is False,
                           timeout_s=15, what="the new engine's state")
            # drawn at the next refresh (later on a loaded machine): the old engine's answers go from the screen
            await wait_for(pilot, lambda: "applied live" not in (text := screen_text(app))
                           and "VRAM reserve 1024 MiB" in text, timeout_s=5, what="the new engine drawn")
    finally:
        _stop(first)
        if second is not None:
            _stop(second)


def test_the_apps_own_polling_stays_out_of_the_engine_log() -> None:
    view = ViewState(mode="launched")
    view.append_log([("stderr", 'INFO:     127.0.0.1:50412 - "GET /health HTTP/1.1" 200 OK'),
                     ("stderr", 'INFO:     127.0.0.1:50412 - "GET /strata/state HTTP/1.1" 200 OK'),
                     ("stderr", 'INFO:     127.0.0.1:50414 - "POST /v1/completions HTTP/1.1" 200 OK')])
    assert [line for _, line in view.log_lines] == ['INFO:     127.0.0.1:50414 - "POST /v1/completions HTTP/1.1" 200 OK']
    assert view.own_polling_lines == 2


def test_a_snapshot_of_another_instance_replaces_what_the_old_one_said() -> None:
    from strata_tui.engine_io.messages import StateSnapshot
    from strata_tui.state.reducer import reduce

    view = ViewState(mode="attached", attach_url="http://x")
    on = {"name": "SPLIT_ATTN", "enabled": True}
    reduce(view, StateSnapshot({"instance_id": "a", "switches": [on], "config": {"vram_reserve_mib": 1536}}), 0, 0)
    view.monitor.switches["SPLIT_ATTN"].note = view.reserve_note = "applied live"
    # The same instance again (a dropped connection): what it said stands.
    reduce(view, StateSnapshot({"instance_id": "a", "switches": [on]}), 0, 0)
    assert view.monitor.switches["SPLIT_ATTN"].note == "applied live"
    # Another instance whose state lacks the switches (still loading): nothing of the old one is kept.
    reduce(view, StateSnapshot({"instance_id": "b", "config": {"vram_reserve_mib": 1024}}), 0, 0)
    split = view.monitor.switches["SPLIT_ATTN"]
    assert split.running is None and split.note == "" and view.reserve_note == ""
    assert view.monitor.vram_reserve_mib == 1024 and view.engine_instance == "b"


def _status_line(app) -> str:
    from strata_tui.widgets.status_bar import status_text

    return status_text(app.view).plain


async def test_a_new_engine_on_the_same_port_is_shown_as_it_is_and_1_turns_its_switch_on(config_dir: Path) -> None:
    """Attach, `1` (SPLIT_ATTN on), the engine dies, another starts on the same port a few seconds later (as a
    restart takes): from the moment it answers, the panel never shows the old engine's switch as current; it
    shows the new engine's (off), and `1` then turns it on there."""
    import httpx

    port = _free_port()
    first, url = _start_fake(port, events=None)
    second = None
    try:
        app = offline_app(config_dir, attach_url=url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
            split = app.view.monitor.switches["SPLIT_ATTN"]
            await pilot.press("1")
            await wait_for(pilot, lambda: split.note == "applied live" and split.running is True, what="applied")
            first.kill()
            first.wait()
            await wait_for(pilot, lambda: app.view.unreachable_since is not None, timeout_s=5, what="unreachable")
            await pilot.pause(4.0)  # the event stream's reconnects back off meanwhile
            second, _ = _start_fake(port, events=None)
            panel = app.screen.query_one(SwitchesPanel)
            deadline = time.monotonic() + 15
            while not (split.running is False and not panel.has_class("-stale")):
                assert time.monotonic() < deadline, "the new engine's state was never shown"
                line = _status_line(app)
                assert not ("unreachable" in line and "ready" in line), line
                if not panel.has_class("-stale"):  # drawn as current: it must be the new engine's
                    assert split.running is not True, "the old engine's switch is shown as the new one's"
                await pilot.pause(0.02)
            await wait_for(pilot, lambda: "applied live" not in screen_text(app), timeout_s=5,
                           what="the old engine's answer gone from the screen")
            await pilot.press("1")
            await wait_for(pilot, lambda: split.running is True and split.note == "applied live",
                           what=f"on again ({split})")
            async with httpx.AsyncClient(base_url=url) as client:
                state = (await client.get("/strata/state")).json()
            assert {s["name"]: s["enabled"] for s in state["switches"]}["SPLIT_ATTN"] is True
    finally:
        _stop(first)
        if second is not None:
            _stop(second)


async def test_the_status_line_drops_a_recovered_error_and_says_nothing_of_a_stop_you_asked_for(
        config_dir: Path, monkeypatch) -> None:
    from tests.tui.conftest import fake_engine_app

    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        os.kill(app.process.pid, signal.SIGSTOP)
        try:
            await wait_for(pilot, lambda: "unreachable" in _status_line(app), timeout_s=5, what="unreachable")
            line = _status_line(app)
            assert "ready" not in line and "Timeout" in line, line  # why, and no "ready" beside it
        finally:
            os.kill(app.process.pid, signal.SIGCONT)
        await wait_for(pilot, lambda: "unreachable" not in _status_line(app) and not app.view.resyncing,
                       timeout_s=5, what="answering again")
        line = _status_line(app)
        assert "Timeout" not in line and "Error" not in line and "telemetry live" in line, line
        await pilot.press("s")
        await wait_for(pilot, lambda: app.view.monitor.engine_state == "exited", what="stopped")
        await pilot.pause(1.5)  # the probes fail meanwhile: a stop you asked for is no error
        line = _status_line(app)
        assert "Error" not in line and "unreachable" not in line, line
