"""Pilot tests of the actions that need no engine: switches and reserve saved to the profile, the graph
filter, help, the profiles screen (new, duplicate, rename, delete, edit with validation, use), broken files."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import DataTable, Input, Static

from strata_tui.engine_io.messages import TelemetryBatch
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.screens.help import HelpScreen
from strata_tui.screens.monitor import MonitorScreen
from strata_tui.screens.profile_editor import ProfileEditor
from strata_tui.screens.profiles import ProfilesScreen
from strata_tui.widgets.graph_events import GraphEventsTable
from strata_tui.widgets.slots_table import SlotsTable
from tests.tui.conftest import offline_app, recorded, screen_text, wait_for

SIZE = (160, 50)


async def test_recorded_events_reach_the_slots_table(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(TelemetryBatch(recorded("seed_run.jsonl")))
        table = app.screen.query_one(SlotsTable)
        await wait_for(pilot, lambda: table.row_count == 8 and "ETA" in str(table.get_cell("6", "progress")),
                       what="the slots drawn")
        assert "prefill" in str(table.get_cell("6", "state")) and "ETA" in str(table.get_cell("6", "progress"))
        before = dict(table.updated)
        app.post_message(TelemetryBatch(recorded("seed_run.jsonl")[-2:]))  # same values again
        await pilot.pause(0.6)
        changed = {cell for cell, n in table.updated.items() if n != before.get(cell, 0)}
        # only the prefilling slot's ETA moves (it counts down every refresh); nothing else is rewritten
        assert changed <= {("6", "progress")}, changed


async def test_switch_key_saves_to_profile_when_no_engine(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("1")
        await pilot.pause()
        assert app.store.load("default").engine.switches == {"SPLIT_ATTN": True}
        assert "next start" in app.view.monitor.switches["SPLIT_ATTN"].note
        await pilot.press("1", "5")
        await pilot.pause()
        assert app.store.load("default").engine.switches == {"SPLIT_ATTN": False, "COMPILE": True}


async def test_reserve_keys_small_and_large_steps_saved(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        start = app.view.profile.engine.vram_reserve_mib
        await pilot.press("plus", "plus", "right_square_bracket", "minus")
        await pilot.pause()
        assert app.view.monitor.vram_reserve_mib == start + 64 + 512
        assert app.store.load("default").engine.vram_reserve_mib == start + 64 + 512
        for _ in range(5):
            await pilot.press("left_square_bracket")
        await pilot.pause()
        assert app.store.load("default").engine.vram_reserve_mib == 0, "the reserve never goes negative"


async def test_filter_cycles_graph_events(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(TelemetryBatch(recorded("seed_run.jsonl")))
        table = app.screen.query_one(GraphEventsTable)
        await wait_for(pilot, lambda: table.row_count > 0, what="the graph events drawn")
        counts = [table.row_count]
        for _ in range(3):
            await pilot.press("f")
            await pilot.pause()
            counts.append(table.row_count)
        assert counts[0] > counts[1] > counts[2] > 0 and counts[3] == counts[0]
        assert "all" in table.border_title


async def test_help_opens_and_closes(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, MonitorScreen)


async def test_help_lists_every_key_and_switch_and_says_how_to_close(config_dir: Path) -> None:
    from textual.app import App
    from textual.keys import key_to_character

    from engine.switches import SWITCHES
    from strata_tui.actions.commands import palette_commands
    from strata_tui.app import StrataApp
    from strata_tui.screens.help import help_text

    app = offline_app(config_dir)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        shown = screen_text(app)
        assert "escape · q · ? close" in shown, shown  # on the border, whatever is scrolled
        page = help_text().plain
        keys = {part.strip() for line in page.splitlines() if line.startswith("  ")
                for part in line.split("  ")[1].split(" / ")}
        named = {"plus": "+", "minus": "-", "space": "space", "equals_sign": "+", "slash": "/"}
        # every key of every binding (f1 beside ?), Textual's own app keys too (ctrl+q quits, ctrl+c does not)
        for binding in [*MonitorScreen.BINDINGS, *StrataApp.BINDINGS, *App.BINDINGS]:
            for key in binding.key.split(","):
                if key.isdigit():
                    assert "1-9" in keys
                    continue
                char = named.get(key) or (key if key == "escape" else key_to_character(key)) or key
                assert char in keys, (binding, sorted(keys))
        for sw in SWITCHES:  # every switch, the ones past the ninth (no key) too
            assert sw.env_var in page, sw.name
        titles = [command.title for command in palette_commands(app)]
        for sw in SWITCHES:
            assert f"Toggle {sw.name}" in titles, sw.name
        assert {"Filter graph events", "Cancel load", "Quit", "Help"} <= set(titles), titles
        await pilot.press("escape")
        assert isinstance(app.screen, MonitorScreen)


async def test_fused_ops_from_the_palette_is_saved_for_the_next_start(config_dir: Path) -> None:
    from strata_tui.actions.commands import palette_commands

    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        before = app.view.monitor.switches["FUSED_OPS"].wanted
        command = next(c for c in palette_commands(app) if c.title == "Toggle FUSED_OPS")
        command.callback()
        await wait_for(pilot, lambda: app.store.load("default").engine.switches.get("FUSED_OPS") is (not before),
                       what="FUSED_OPS saved")
        # the note changes when the save's thread hands back, which may come a moment after the file is written
        switch = app.view.monitor.switches["FUSED_OPS"]
        await wait_for(pilot, lambda: switch.note != "saving: applies at the next start", what="the note after the save")
        assert switch.note == "saved: applies at the next start"


async def test_load_without_engine_says_why(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("l")
        await pilot.pause()
        assert any("not ready" in n.message for n in app._notifications)


async def _open_profiles(pilot) -> ProfilesScreen:
    await pilot.press("p")
    await pilot.pause()
    assert isinstance(pilot.app.screen, ProfilesScreen)
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.reads_done >= 1, what="the profiles read")
    return screen


async def _type_name(pilot, name: str) -> None:
    field = pilot.app.screen.query_one(Input)
    field.value = ""
    await pilot.press(*name, "enter")
    await pilot.pause()


async def test_profiles_new_duplicate_rename_delete(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _open_profiles(pilot)
        await pilot.press("n")
        await pilot.pause()
        await _type_name(pilot, "bad name")
        assert "name=" in str(app.screen.query_one("#error").render())  # refused, dialog still open
        await _type_name(pilot, "fast")
        await wait_for(pilot, lambda: screen.selected_name == "fast", what="fast created and selected")
        assert app.store.names() == ["default", "fast"]
        await pilot.press("d")
        await pilot.pause()
        await _type_name(pilot, "fast2")
        await wait_for(pilot, lambda: screen.selected_name == "fast2", what="fast2 created and selected")
        assert app.store.names() == ["default", "fast", "fast2"]
        await pilot.press("r")
        await pilot.pause()
        await _type_name(pilot, "slow")
        await wait_for(pilot, lambda: screen.selected_name == "slow", what="renamed and selected")
        assert app.store.names() == ["default", "fast", "slow"]
        await pilot.press("x")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: app.store.names() == ["default", "fast"], what="deleted")
        await pilot.press("escape")
        assert isinstance(app.screen, MonitorScreen)


async def test_profiles_table_keeps_its_columns_starts_on_the_active_one_and_says_no_toasts(config_dir: Path) -> None:
    from engine.switches import SWITCHES

    store = ProfileStore(config_dir)
    for name in ("aaa-first", "long-context-big"):
        store.save(Profile(name))
    (store.profiles_dir / "zz-broken.toml").write_text("[engine]\nkv = 'fp8'\n")
    app = offline_app(config_dir, profile="long-context-big")
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await _open_profiles(pilot)
        assert screen.selected_name == "long-context-big"  # the active profile, not the first row
        detail = str(screen.query_one("#detail", Static).render())
        for sw in SWITCHES:  # defaults count: "switches on: none" while five were on by default
            if sw.default:
                assert f"{sw.name} (default)" in detail, detail
        for key, name in (("n", "newone"), ("d", "dup-of-it"), ("r", "renamed-one")):
            await pilot.press(key)
            await _type_name(pilot, name)
            await wait_for(pilot, lambda: name in screen_text(app), what=name)
            shown = screen_text(app)
            assert "long-context-big" in shown and "builtin:strata-tiny" in shown, shown  # full width columns
        broken_row = next(line for line in screen_text(app).splitlines() if "zz-broken" in line)
        assert "broken: line 2" in broken_row and "?" not in broken_row, broken_row
        screen.query_one(DataTable).move_cursor(row=screen.query_one(DataTable).get_row_index("zz-broken"))
        await pilot.press("enter")  # refused: the reason goes above the details, not into a toast
        await pilot.pause()
        assert not app._notifications, [n.message for n in app._notifications]
        assert "fp8" in str(screen.query_one("#detail", Static).render())


async def test_edit_rejects_bad_value_naming_it_then_saves(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        await _open_profiles(pilot)
        await pilot.press("e")
        await pilot.pause()
        editor = app.screen
        assert isinstance(editor, ProfileEditor)
        editor.query_one("#f-batch", Input).value = "lots"
        await pilot.press("ctrl+s")
        await pilot.pause()
        error = str(editor.query_one("#error", Static).render())
        assert "batch" in error and "lots" in error and "whole number" in error
        assert editor.query_one("#f-batch").has_class("-invalid-value")
        editor.query_one("#f-batch", Input).value = "6"
        editor.query_one("#f-kv_resident", Input).value = "4096"
        editor.query_one("#f-device", Input).value = "cpu"
        editor.query_one("#s-SPLIT_ATTN").value = True
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="the editor closed on save")
        saved = app.store.load("default").engine
        assert (saved.batch, saved.kv_resident, saved.device, saved.switches["SPLIT_ATTN"]) == (6, 4096, "cpu", True)
        assert app.view.monitor.switches["SPLIT_ATTN"].wanted


async def test_use_profile_makes_it_current_and_last_used(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    store.open_initial()
    store.create("other")
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _open_profiles(pilot)
        table = screen.query_one(DataTable)
        table.move_cursor(row=table.get_row_index("other"))
        await pilot.press("enter")
        await pilot.pause()
        assert app.view.profile.name == "other" and ProfileStore(config_dir).last_used() == "other"


async def test_broken_profile_at_start_shows_path_and_line_and_is_kept(config_dir: Path) -> None:
    profiles = config_dir / "profiles"
    profiles.mkdir(parents=True)
    broken = '[engine]\nbatch = "six"\n'
    (profiles / "default.toml").write_text(broken)
    app = offline_app(config_dir, launch=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="the profiles screen")
        screen = app.screen
        await wait_for(pilot, lambda: screen.reads_done >= 1, what="the profiles read")
        detail = str(app.screen.query_one("#detail", Static).render())
        assert "default.toml, line 2" in detail and "engine.batch" in detail
        assert app.process is None, "a broken profile must not launch anything"
        await pilot.press("escape", "1", "plus")
        await pilot.pause()
    assert (profiles / "default.toml").read_text() == broken


async def test_command_palette_runs_an_action(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Toggle COMPILE")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.store.load("default").engine.switches.get("COMPILE") is True,
                       what="COMPILE saved on")


def test_pick_error_line_skips_logger_names_and_info_records() -> None:
    from strata_tui.state.view_state import pick_error_line

    lines = ["strata-engine serve: error: CheckpointError: /m/model.safetensors: cannot open as safetensors",
             "2026-11-29 18:55:03,678 INFO uvicorn.error: Shutting down",
             "2026-11-29 18:55:03,782 INFO uvicorn.error: Finished server process [26765]"]
    assert pick_error_line(lines) == lines[0]
    assert pick_error_line(["Traceback (most recent call last):", "  File x", "RuntimeError: CUDA error: boom"]) \
        == "RuntimeError: CUDA error: boom"
    # a line that is neither a WARNING/ERROR record nor states an error is not "the last error"
    assert pick_error_line(["just a line", "INFO: Application startup complete."]) is None
    assert pick_error_line([]) is None
    assert pick_error_line(["WARNING: tier: shrinking", "INFO: 127.0.0.1 GET /health 200"]) == "WARNING: tier: shrinking"


async def test_edit_cancel_leaves_the_file_alone(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        before = app.store.path("default").read_text()
        await _open_profiles(pilot)
        await pilot.press("e")
        await pilot.pause()
        app.screen.query_one("#f-batch", Input).value = "7"
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("y")  # discard the unsaved change
        await pilot.pause()
        assert isinstance(app.screen, ProfilesScreen)
        assert app.store.path("default").read_text() == before


async def test_attached_engine_exit_event_opens_the_crash_panel(config_dir: Path) -> None:
    app = offline_app(config_dir, attach_url="http://127.0.0.1:9")
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(TelemetryBatch(recorded("crash_run.jsonl")))
        await wait_for(pilot, lambda: app.view.crash is not None, what="the exit event folded in")
        assert app.view.crash.returncode == 1
        assert "illegal memory access" in app.view.crash.error and "VRAM free 1 MiB" in app.view.crash.error


async def test_error_event_arriving_after_the_exit_still_reaches_the_crash_panel(config_dir: Path) -> None:
    from strata_tui.engine_io.messages import EngineExited, EngineOutput

    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(EngineOutput([("stderr", "2026-11-29 INFO uvicorn.error: Shutting down")]))
        app.post_message(EngineExited(1, False, None, app.run_id))
        await pilot.pause()
        assert "illegal memory access" not in (app.view.crash.error or "")
        app.post_message(TelemetryBatch(recorded("crash_run.jsonl")))
        await wait_for(pilot, lambda: app.view.crash.recent, what="the engine's events folded in")
        assert "illegal memory access" in app.view.crash.error
        assert app.view.crash.recent[-1].type == "engine"
