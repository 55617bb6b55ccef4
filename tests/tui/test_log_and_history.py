"""The engine log as a tool (filter with `/`, pause with space, copy a line or the last error to the clipboard
with OSC 52, save to a file) and the history panel (`z` zooms 1 → 5 → 15 minutes), against the fake engine: a
real process with a real HTTP server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strata_tui.widgets.engine_log import EngineLog
from strata_tui.widgets.history_panel import HistoryPanel
from tests.tui.conftest import fake_engine_app, screen_text, wait_for

SIZE = (160, 48)


async def test_log_filter_pause_copy_and_save(config_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("STRATA_TUI_LOG_DIR", str(tmp_path / "logs"))
    app = fake_engine_app(config_dir, monkeypatch)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.monitor.engine_state == "ready" and app.view.telemetry_connected,
                       20, "the engine")
        log = app.screen.query_one(EngineLog)
        await wait_for(pilot, lambda: any("ready at" in line for line in log.shown), 10, "the ready line in the log")
        await pilot.press("slash")
        await pilot.press(*"ready at")
        await pilot.press("enter")
        await wait_for(pilot, lambda: "filter 'ready at'" in screen_text(app), 10, "the filter in the log's title")
        text = screen_text(app)
        assert "strata-engine: ready at http://127.0.0.1:" in text
        assert "loading 60%" not in text and "fake engine argv" not in text  # the lines that do not match are gone
        await pilot.press("space")
        await wait_for(pilot, lambda: "paused" in screen_text(app), 10, "paused in the log's title")
        await pilot.press("y")
        assert app.clipboard.startswith("strata-engine: ready at http://127.0.0.1:"), app.clipboard
        await pilot.press("w")
        await wait_for(pilot, lambda: list((tmp_path / "logs").glob("*.log")), 10, "the saved log")
        saved = next((tmp_path / "logs").glob("*.log")).read_text()
        assert saved.startswith("strata-engine: ready at http://127.0.0.1:") and saved.count("\n") == 1, saved
        await pilot.press("slash", *["backspace"] * len("ready at"), "enter")  # an empty filter: every line again
        await wait_for(pilot, lambda: "loading 60%" in screen_text(app), 10, "every line again")
        await pilot.press("space")
        await wait_for(pilot, lambda: "paused" not in screen_text(app), 10, "the log following again")
        await pilot.press("q")


async def test_e_copies_the_engines_last_error(config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, mode="crash")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.crash is not None and app.view.crash.error, 20, "the crash")
        await pilot.press("e")
        assert app.clipboard == "mtp: round capture: CUDA error: an illegal memory access was encountered"
        await pilot.press("q")


async def test_history_panel_draws_tok_s_and_z_zooms(config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_BUSY", "6:30")
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.screen.query_one(HistoryPanel)
        # six slots at 30 tok/s each: the panel's tok/s reads their sum once samples come (one a second)
        await wait_for(pilot, lambda: "tok/s 18" in screen_text(app), 30, "tok/s in the history panel")
        assert "History · last 1 min · z zoom" in screen_text(app)
        rates = [v for v in app.view.history.window("tok_s", 60) if v]
        assert rates and all(170 < v < 190 for v in rates[-3:]), rates
        for minutes in (5, 15, 1):
            await pilot.press("z")
            await wait_for(pilot, lambda: f"History · last {minutes} min" in screen_text(app), 10, f"{minutes} min")
        assert panel.window_s == 60
        await pilot.press("q")


async def test_an_engine_on_the_cpu_has_its_cpu_and_memory_in_the_history(config_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile with `device = "cpu"`: the history adds the engine process tree's CPU (100 % is one core) and its
    resident memory, read with psutil from the process the app launched."""
    import psutil

    from strata_tui.profiles.profile import Profile
    from strata_tui.profiles.store import ProfileStore

    ProfileStore(config_dir).save(Profile("default").with_engine(device="cpu"))
    monkeypatch.setenv("FAKE_ENGINE_BUSY", "6:30")
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "engine RAM" in screen_text(app), 30, "the engine's RAM in the history")
        assert "engine CPU" in screen_text(app)
        ram = [v for v in app.view.history.window("ram_mib", 60) if v]
        rss = psutil.Process(app.process.pid).memory_info().rss / 2**20
        assert ram and 0.5 * rss < ram[-1] < 2 * rss + 64, (ram[-1], rss)
        await wait_for(pilot, lambda: any(v for v in app.view.history.window("cpu_pct", 60)), 20, "a CPU reading")
        await pilot.press("q")


async def test_an_moe_engine_has_its_expert_cache_hit_rate_in_the_history(config_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An MoE engine (a recorded /strata/state with an `experts` section: 310 hits, 441 misses): the history adds
    the expert cache's hit rate, drawn as a percentage beside the other lines."""
    monkeypatch.setenv("FAKE_ENGINE_EXPERTS", str(Path(__file__).parent / "fixtures" / "moe_state.json"))
    monkeypatch.setenv("FAKE_ENGINE_BUSY", "6:30")
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "experts hit 41%" in screen_text(app), 30, "the hit rate in the history")
        rates = [v for v in app.view.history.window("expert_hit", 60) if v is not None]
        assert rates and abs(rates[-1] - 310 / 751) < 1e-3, rates
        await pilot.press("q")
