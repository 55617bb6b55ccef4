"""The profile editor covers every option, reads at a glance and never drops work silently; the profiles
table shows whole names and says "off" for MTP off."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from textual.widgets import Checkbox, DataTable, Input, Label

from engine.config import EngineConfig
from engine.switches import SWITCHES
from strata_tui.profiles.profile import TuiSettings
from strata_tui.profiles.store import ProfileStore
from strata_tui.screens.dialogs import ConfirmDialog
from strata_tui.screens.profile_editor import ProfileEditor, form_fields
from strata_tui.screens.profiles import ProfilesScreen
from tests.tui.conftest import offline_app, screen_text, wait_for

SIZE = (160, 50)


async def _open_editor(app, pilot) -> ProfileEditor:
    await pilot.press("p")
    await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="profiles")
    screen = app.screen
    await wait_for(pilot, lambda: screen.reads_done >= 1, what="the profiles read")
    await pilot.press("e")
    await wait_for(pilot, lambda: isinstance(app.screen, ProfileEditor), what="editor")
    await pilot.pause()
    return app.screen


async def test_the_editor_has_a_field_for_every_engine_option_and_tui_setting(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        for f in fields(EngineConfig):
            if f.name != "switches":
                assert editor.query(f"#f-{f.name}"), f"no field for engine option {f.name}"
        for f in fields(TuiSettings):
            assert editor.query(f"#t-{f.name}"), f"no field for [tui] {f.name}"


async def test_new_fields_save_only_what_changed_and_keep_the_file(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    store.profiles_dir.mkdir(parents=True)
    path = store.profiles_dir / "default.toml"
    path.write_text('# mine\n[engine]\nmodel = "builtin:strata-tiny"  # tiny\n')
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        editor.query_one("#f-prefill_chunk_tokens", Input).value = "1024"
        editor.query_one("#f-tier_wait_interval_s", Input).value = "0.25"
        editor.query_one("#f-dtype").value = "float32"
        editor.query_one("#f-graphs", Checkbox).value = False
        editor.query_one("#t-reserve_step_mib", Input).value = "128"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="saved")
        await wait_for(pilot, lambda: "1024" in path.read_text(), what="written")
    saved = store.load("default")
    assert (saved.engine.prefill_chunk_tokens, saved.engine.tier_wait_interval_s, saved.engine.dtype,
            saved.engine.graphs, saved.tui.reserve_step_mib) == (1024, 0.25, "float32", False, 128)
    text = path.read_text()
    assert text.startswith("# mine\n") and 'model = "builtin:strata-tiny"  # tiny' in text
    assert "batch" not in text, "keys the editor did not change are not written"


async def test_checkboxes_read_on_and_off(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        box = editor.query_one("#f-batch_mtp", Checkbox)
        assert box.value is False and "off" in str(box.label)
        box.focus()
        await pilot.press("space")
        await pilot.pause()
        assert box.value is True and "on" == str(box.label)
        assert "off" in str(editor.query_one("#s-SPLIT_ATTN", Checkbox).label)


async def test_the_focused_input_is_visible(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        batch, port = editor.query_one("#f-batch", Input), editor.query_one("#f-port", Input)
        batch.focus()
        await pilot.pause()
        assert batch.styles.background != port.styles.background


async def test_escape_with_unsaved_changes_asks(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        await pilot.press("escape")  # nothing changed: leaves at once
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="left")
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfileEditor), what="editor again")
        editor = app.screen
        editor.query_one("#f-batch", Input).value = "9"
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), what="the question")
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen is editor, what="back to the editor")
        assert editor.query_one("#f-batch", Input).value == "9"
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), what="asked again")
        await pilot.press("y")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="discarded")
        assert app.store.load("default").engine.batch != 9


async def test_profiles_table_shows_whole_names_and_mtp_off(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    store.create("long-ctx-big-box-with-a-long-name")
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="profiles")
        await pilot.pause()
        store.duplicate("long-ctx-big-box-with-a-long-name", "long-ctx-big-box-with-a-long-name-copy")
        screen, reads = app.screen, app.screen.reads_done
        screen.reload()
        await wait_for(pilot, lambda: screen.reads_done > reads, what="the profiles read again")
        text = screen_text(app)
        assert "long-ctx-big-box-with-a-long-name-copy" in text
        table = app.screen.query_one(DataTable)
        mtp_column = [c.label.plain for c in table.columns.values()].index("MTP")
        assert str(table.get_row("default")[mtp_column]) == "off" and "d1" not in text


HAND_WRITTEN = """\
# my box
[engine]
model = "builtin:strata-tiny"   # the embedded one
batch = 3                        # three people at once

[tui]
refresh_s    = 0.25
"""


async def test_ctrl_s_writes_only_the_changed_key_not_every_switch(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    store.profiles_dir.mkdir(parents=True)
    path = store.profiles_dir / "default.toml"
    path.write_text(HAND_WRITTEN)
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        editor.query_one("#f-batch", Input).value = "4"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: "batch = 4" in path.read_text(), what="saved")
    assert path.read_text() == HAND_WRITTEN.replace("batch = 3 ", "batch = 4 ")


def _serve_options() -> set[str]:
    import argparse

    from engine.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}


async def test_the_editor_has_a_field_for_every_serve_option(config_dir: Path) -> None:
    options = _serve_options()
    assert "log_level" in options and "vram_reserve_mib" in options
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        editor = await _open_editor(app, pilot)
        missing = sorted(name for name in options if not editor.query(f"#f-{name}"))
        assert missing == [], f"serve options with no editor field: {missing}"
        editor.query_one("#f-log_level").value = "debug"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="saved")
    saved = app.store.load("default").engine
    assert saved.log_level == "debug" and "--log-level debug" in " ".join(saved.to_argv())


async def test_first_focus_is_the_first_field_and_typing_never_replaces_it(config_dir: Path) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(3):
            editor = await _open_editor(app, pilot)
            assert app.focused is not None and app.focused.id == "f-model", app.focused
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="back")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, ProfilesScreen), what="monitor")
        editor = await _open_editor(app, pilot)
        await pilot.press("0")
        assert editor.query_one("#f-model", Input).value == "builtin:strata-tiny0", "the value was selected"


def _normal(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("size", [(100, 30), (80, 24)], ids=["100x30", "80x24"])
async def test_every_label_is_shown_whole(config_dir: Path, size: tuple[int, int]) -> None:
    app = offline_app(config_dir)
    async with app.run_test(size=size) as pilot:
        editor = await _open_editor(app, pilot)
        labels = list(editor.query(Label))
        assert len(labels) >= 30
        cut, shown_texts = [], set()
        for label in labels:
            label.scroll_visible(animate=False, immediate=True)
            await pilot.pause()
            lines = screen_text(app).splitlines()
            region = label.region
            shown = " ".join(line[region.x:region.right] for line in lines[region.y:region.bottom])
            shown_texts.add(_normal(shown))
            if _normal(shown) != _normal(str(label.content)):
                cut.append((str(label.content), shown.strip()))
        assert cut == [], cut
        wanted = [f.label for f in form_fields()] + [f"{sw.env_var}: {sw.description}" for sw in SWITCHES]
        assert [text for text in wanted if _normal(text) not in shown_texts] == []
