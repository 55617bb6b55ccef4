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

from strata_tui.view_state import ViewState
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
            assert not app.screen.query_one(SlotsTable).has_class("-stale")
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
            await pilot.pause(0.3)
            text = screen_text(app)
            assert "applied live" not in text and "VRAM reserve 1024 MiB" in text
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


async def test_an_engine_that_names_its_instance_is_recognised_as_new_on_reconnect() -> None:
    from strata_tui.messages import StateSnapshot
    from strata_tui.workers import stream_telemetry

    class TwoConnections:
        """The worker's collaborator: connects twice, the second time to another engine instance."""

        engine_restarts = 0

        def __init__(self) -> None:
            self.states = [{"instance_id": "a", "slots": []}, {"instance_id": "b", "slots": []}]

        async def state(self) -> dict:
            return self.states.pop(0)

        async def events(self, on_status, on_connect):
            for _ in range(2):
                await on_connect()
                yield []

    posted: list = []
    await stream_telemetry(posted.append, TwoConnections())
    assert [m.fresh_engine for m in posted if isinstance(m, StateSnapshot)] == [False, True]
