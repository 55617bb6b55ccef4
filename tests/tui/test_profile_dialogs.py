"""The name dialog of new / duplicate / rename: a refused name keeps the dialog open with the whole reason
on screen, so the next keys still go to the dialog (never to the list behind it, where Enter would relaunch
the engine with another profile)."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input

from strata_tui.profiles.store import ProfileStore
from strata_tui.screens.dialogs import NameDialog
from strata_tui.screens.profiles import ProfilesScreen
from tests.tui.conftest import offline_app, screen_text, wait_for


def _normal(text: str) -> str:
    """Without any whitespace: a long path folds across lines without a space."""
    return "".join(text.split())


def _dialog_text(app) -> str:
    """What the dialog's box shows, its lines joined (a wrapped message reads as one)."""
    box = app.screen.query("Vertical").first()
    lines = screen_text(app).splitlines()
    region = box.region
    return _normal("".join(line[region.x:region.right].strip(" ▊▎▌▐█│┃") for line in
                           lines[region.y:region.bottom]))


async def _type(pilot, text: str) -> None:
    field = pilot.app.screen.query_one(Input)
    field.value = ""
    await pilot.press(*text, "enter")


@pytest.mark.parametrize("size", [(100, 30), (80, 24)], ids=["100x30", "80x24"])
@pytest.mark.parametrize("key,taken", [("n", "default"), ("d", "other"), ("r", "other")])
async def test_a_taken_name_keeps_the_dialog_open_with_the_whole_reason(config_dir: Path, size, key: str,
                                                                        taken: str) -> None:
    store = ProfileStore(config_dir)
    store.open_initial()
    store.create("other")
    app = offline_app(config_dir)
    async with app.run_test(size=size) as pilot:
        await pilot.press("p")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="profiles")
        await pilot.pause()
        await pilot.press(key)
        await wait_for(pilot, lambda: isinstance(app.screen, NameDialog), what="the dialog")
        await _type(pilot, taken)
        reason = f"a profile with this name exists ({store.path(taken)})"
        await wait_for(pilot, lambda: _normal(reason) in _dialog_text(app), what="the whole reason")
        assert isinstance(app.screen, NameDialog)
        await pilot.press("enter")  # again: still the dialog's, nothing else happens
        await pilot.pause(0.3)
        assert isinstance(app.screen, NameDialog) and app.view.profile.name == "default"
        await _type(pilot, "bad name")
        rule = "use 1-64 letters, digits, '.', '-' or '_', starting with a letter or digit"
        await wait_for(pilot, lambda: _normal(rule) in _dialog_text(app), what="the whole name rule")
        await _type(pilot, "fresh")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="the dialog closed")
        await wait_for(pilot, lambda: app.screen.selected_name == "fresh", what="the new name selected")
    names = store.names()
    assert "fresh" in names and taken in names
    if key == "r":  # the selected row, the current profile, was renamed: the app follows it
        assert "default" not in names and app.view.profile.name == "fresh"
    else:
        assert "default" in names and app.view.profile.name == "default"
