"""The panel shown when the engine ends: how (stopped by you, killed by a signal, exit code), the last real
error (a WARNING/ERROR line or error event, never an INFO line), the last events, and the restart key. Handed the
app's view state, the panel shows itself while the view has a crash, on its own tick (widgets/view_bound.py)."""

from __future__ import annotations

import signal

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.telemetry import Event
from strata_tui.state.view_state import CrashInfo, severity_of
from strata_tui.widgets.view_bound import ViewBound

_NOISE = ("v", "ts", "seq", "type")
_ZERO_MEANS_SOMETHING = ("slot", "exit_code", "index")  # slot 0 is a slot, exit code 0 is a clean exit


def event_line(event: Event) -> str:
    data = event.to_json()
    for noise in _NOISE:
        data.pop(noise, None)
    body = ", ".join(f"{k}={v}" for k, v in data.items()
                     if v is not None and v != "" and (v not in (0, 0.0) or k in _ZERO_MEANS_SOMETHING))
    return f"#{event.seq} {event.type}: {body}"[:200]


def how_it_ended(crash: CrashInfo) -> str:
    code = crash.returncode
    if crash.requested and crash.why_stopped:
        ended = f"stopped ({crash.why_stopped})"
    elif crash.requested:
        ended = "stopped"
    elif code is None:
        ended = "exited"
    else:
        ended = ""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        killed = f"killed by {name}"
        return f"{ended}: {killed}" if ended else killed
    detail = f"exit code {code}" if code is not None else "exit code unknown"
    return f"{ended}, {detail}" if ended else f"exited with {detail}"


class CrashPanel(ViewBound, Static):
    """Why the engine stopped. Hidden until `show()` is called; `hide()` after a restart."""

    DEFAULT_CSS = """
    CrashPanel { height: auto; max-height: 14; border: heavy $error; padding: 0 1; display: none; }
    CrashPanel.-visible { display: block; }
    """

    def redraw(self, force: bool = False) -> None:
        """Show the view's crash when it changed (late events may bring its real error); hide it once gone."""
        view = self.changed_view(force)
        if view is None:
            return
        crash = view.crash
        if crash is not None:
            if self.slice_changed((id(crash), crash.returncode, crash.error, len(crash.recent), crash.requested,
                                   crash.why_stopped), force):
                self.show(crash)
        elif self.visible_now:
            self.forget_slice()
            self.hide()

    def show(self, crash: CrashInfo) -> None:
        lines: list = [Text.assemble((f"engine {how_it_ended(crash)}", "bold red"), ("    press r to restart", "bold"))]
        severity = severity_of(crash.error) if crash.error else "error"
        lines.append(Text.assemble((f"last {severity}: ", "bold"),
                                   (crash.error or "none reported",
                                    ("yellow" if severity == "warning" else "red") if crash.error else "dim")))
        if crash.recent:
            height = self.app.size.height
            shown = 8 if height >= 40 else 3 if height >= 34 else 1  # a short terminal keeps the switches in view
            lines.append(Text("last events:", style="bold"))
            for event in crash.recent[-shown:]:
                line = Text("  " + event_line(event), style="dim")
                line.no_wrap, line.overflow = True, "ellipsis"
                lines.append(line)
        self.update(Group(*lines))
        self.add_class("-visible")

    def hide(self) -> None:
        self.remove_class("-visible")

    @property
    def visible_now(self) -> bool:
        return self.has_class("-visible")
