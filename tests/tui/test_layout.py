"""The monitor at 100x30 keeps the reserve line, every switch, and each slot's tok/s and MTP acceptance on
screen without horizontal scrolling; at 200x55 the slots table uses the width; the status line's fields
never run together."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.switches import SWITCHES
from strata_tui.engine_io.messages import EngineExited, EngineOutput, TelemetryBatch
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.widgets.slots_table import SlotsTable
from tests.tui.conftest import offline_app, recorded, screen_text
from tests.tui.test_snapshots import LOG, _gpu_minute, _settle


@pytest.fixture
def seeded(tmp_path: Path) -> Path:
    ProfileStore(tmp_path).save(Profile("seed").with_switch("SPLIT_ATTN", True))
    return tmp_path


async def _monitor_text(config: Path, size: tuple[int, int], crash: bool = False) -> tuple[str, object]:
    app = offline_app(config, profile="seed")
    async with app.run_test(size=size) as pilot:
        app.clock = lambda: 1000.0
        _gpu_minute(app)
        app.post_message(EngineOutput(LOG))
        app.post_message(TelemetryBatch(recorded("crash_run.jsonl" if crash else "seed_run.jsonl")))
        if crash:
            await pilot.pause(0.3)
            app.post_message(EngineExited(1, False, None, app.run_id))
        await _settle(pilot)
        table = app.screen.query_one(SlotsTable)
        return screen_text(app), (table.virtual_size.width, table.scrollable_content_region.width)


@pytest.mark.parametrize("crash", [False, True])
async def test_100x30_keeps_reserve_switches_rate_and_acceptance_in_view(seeded: Path, crash: bool) -> None:
    text, (content_w, visible_w) = await _monitor_text(seeded, (100, 30), crash)
    lines = text.splitlines()
    assert len(lines) == 30 and all(len(line) <= 100 for line in lines)
    assert "VRAM reserve 1024 MiB" in text
    for sw in SWITCHES:  # a dense engine: the MoE-only switches are not listed (it marks them unavailable)
        assert (sw.name in text) != sw.moe_only, f"switch {sw.name} is {'' if sw.moe_only else 'not '}on screen"
    if not crash:
        assert "tok/s" in text and "MTP" in text
        assert "27.0" in text and "69%" in text, "slot 0's decode rate and acceptance"
        assert content_w <= visible_w, "the slots table scrolls sideways"


async def test_200x55_slots_table_has_no_wide_empty_margin(seeded: Path) -> None:
    text, (content_w, visible_w) = await _monitor_text(seeded, (200, 55))
    assert visible_w - content_w < 12, (content_w, visible_w)
    assert "first token" in text and "TTFT" in text


async def test_status_line_fields_are_separated(seeded: Path) -> None:
    text, _ = await _monitor_text(seeded, (100, 30))
    status = text.splitlines()[1]
    assert "profile seed · offline · engine ready" in status, status
    for glued in ("offlineengine", "launchedengine", "readyhttp", "liveseed", "MiB+/-"):
        assert glued not in status and glued not in text, glued


LOGGING_LINES = [
    ("stderr", "2026-12-02 19:00:00,123 INFO engine.server.uvicorn_server: listening for requests on port 8765"),
    ("stderr", "2026-12-02 19:00:01,456 WARNING engine.exec.graphs: graph capture retried after freeing memory"),
]


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
async def test_log_lines_lead_with_their_message_and_the_footer_keeps_quit_and_help(seeded: Path,
                                                                                    size: tuple[int, int]) -> None:
    app = offline_app(seeded, profile="seed")
    async with app.run_test(size=size) as pilot:
        app.post_message(EngineOutput(LOGGING_LINES))
        await _settle(pilot)
        shown = screen_text(app)
    assert "listening for requests" in shown, shown
    assert "WARNING graph capture retried" in shown, shown
    footer = shown.rstrip("\n").splitlines()[-1]
    assert "q Quit" in footer and "? Help" in footer, footer


async def test_80x24_keeps_every_switch_and_the_slot_rates_and_says_where_the_rest_went(seeded: Path) -> None:
    """At 80x24 the monitor chooses what to drop: the lower left shows one panel (the log) and a line names the
    others and the key that shows them; the slots table drops the request, prompt and cached columns and says so
    in its title; every switch and each slot's tok/s stay on screen, nothing scrolls sideways."""
    from strata_tui.screens.monitor import MonitorScreen

    app = offline_app(seeded, profile="seed")
    async with app.run_test(size=(80, 24)) as pilot:
        app.clock = lambda: 1000.0
        _gpu_minute(app)
        app.post_message(EngineOutput(LOG))
        app.post_message(TelemetryBatch(recorded("seed_run.jsonl")))
        await _settle(pilot)
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        for sw in SWITCHES:
            assert (sw.name in text) != sw.moe_only, f"switch {sw.name} at 80x24"
        assert "VRAM reserve" in text
        assert "tok/s" in text and "MTP" in text and "27.0" in text, text
        assert "Slots (request, prompt, cached: 100+ columns)" in text, text
        assert "v shows: history, graph cache" in text, text
        table = app.screen.query_one(SlotsTable)
        assert table.virtual_size.width <= table.scrollable_content_region.width, "the slots table scrolls sideways"
        assert "+" in text and "more:" in text  # the slots left out are counted
        await pilot.press("v")
        await _settle(pilot)
        text = screen_text(app)
        assert "History · last 1 min" in text and "v shows: graph cache, engine log" in text, text
        await pilot.press("v")
        await _settle(pilot)
        assert "Graph cache" in screen_text(app)
        assert isinstance(app.screen, MonitorScreen)
