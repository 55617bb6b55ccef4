"""Switches and VRAM reserve: one line per opt-in switch (its key, on/off, live or start-only, degraded and why
or n/a here and why, the last control answer) and the reserve with its keys on the panel's bottom border (where
no switch can push it out of view; the answer to the last reserve change is a line below the switches). Every
line is one terminal line (cut with an ellipsis, never wrapped), so at 100x30 every switch and the reserve stay on
screen. Handed the app's view state, the panel reads them on its own tick (widgets/view_bound.py)."""

from __future__ import annotations

from dataclasses import astuple

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.switches import SWITCHES
from strata_tui.state.monitor_state import KEYED_SWITCHES, MonitorState, SwitchView
from strata_tui.widgets.view_bound import ViewBound


def listed_switches(state: MonitorState) -> list[tuple[str, SwitchView]]:
    """(its key, the switch) for each switch the panel lists, in the registry's order (the number keys; a switch
    past the ninth has none, "·"). An MoE-only switch is listed for an MoE engine, or where the profile or the
    engine has it on."""
    return [(str(i + 1) if sw in KEYED_SWITCHES else "·", state.switches[sw.name])
            for i, sw in enumerate(SWITCHES) if sw.name in state.switches
            and (not sw.moe_only or state.experts is not None or state.switches[sw.name].wanted
                 or bool(state.switches[sw.name].running))]


def switch_line(key: str, view: SwitchView) -> Text:
    on = view.running if view.running is not None else view.wanted
    text = Text.assemble((f" {key} ", "reverse"), " ", ("●" if on else "○", "green" if on else "dim"),
                         f" {view.name:<14}")
    if view.unavailable and view.note:  # what became of the key press first: the reason may be cut
        text.append(f" {view.note}: {view.reason}", style="dim")
        return _one_line(text)
    if view.unavailable:  # not a failure: this engine cannot run it (the reason says why)
        text.append(f" n/a: {view.reason}", style="dim")
    elif view.degraded:
        text.append(f" degraded: {view.reason}", style="bold red")
    elif view.needs_restart:
        text.append(f" {'on' if view.wanted else 'off'} in profile: restart to apply", style="yellow")
    elif view.running is None:
        text.append(" (profile) live" if view.live else " (profile) start only", style="dim")
    else:
        text.append(" live" if view.live else " start only", style="dim")
    if view.note and not view.degraded:
        text.append(f"  {view.note}", style="dim italic")
    return _one_line(text)


def reserve_lines(reserve_mib: int | None, steps_mib: tuple[int, int], note: str = "") -> list[Text]:
    small, large = steps_mib
    line = Text.assemble(("VRAM reserve ", "bold"), (f"{reserve_mib} MiB" if reserve_mib is not None else "N/A",
                                                     "yellow"), (f" · +/- {small} · ]/[ {large}", "dim"))
    lines = [_one_line(line)]
    if note:
        lines.append(_one_line(Text(f"  {note}", style="dim italic")))
    return lines


def _one_line(text: Text) -> Text:
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


class SwitchesPanel(ViewBound, Static):
    """Draws the switch list and the reserve; the monitor binds keys 1-9 and the reserve steps."""

    DEFAULT_CSS = """
    SwitchesPanel { height: auto; padding: 0 1; }
    SwitchesPanel.-stale { text-opacity: 45%; }
    """

    dims_when_stale = True

    def redraw(self, force: bool = False) -> None:
        """Draw the listed switches, the reserve, its steps and the last answers, when any of them changed."""
        view = self.changed_view(force)
        if view is None:
            return
        state = view.monitor
        views = listed_switches(state)
        settings = view.settings
        steps = (settings.reserve_step_mib, settings.reserve_big_step_mib)
        if self.slice_changed((tuple((key, astuple(v)) for key, v in views), state.vram_reserve_mib, steps,
                               view.reserve_note), force):
            self.show(views, state.vram_reserve_mib, steps, view.reserve_note)

    def show(self, views: list[tuple[str, SwitchView]], reserve_mib: int | None, steps_mib: tuple[int, int],
             reserve_note: str = "") -> None:
        """`views`: (its key, the switch) for each switch listed."""
        lines = [switch_line(key, v) for key, v in views]
        reserve, *note = reserve_lines(reserve_mib, steps_mib, reserve_note)
        if self.border_subtitle != reserve.markup:
            self.border_subtitle = reserve
        self.update(Group(*lines, *note), layout=False)  # its size is set by the layout, not by its lines
