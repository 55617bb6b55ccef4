"""One line under the header: whose engine (profile or attached URL), its state, the URL, whether it
answers, and the latest note. Fields are joined with " · " so they never run together. Handed the app's view
state, the bar reads it on its own tick (widgets/view_bound.py)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static

from strata_tui.state.view_state import ViewState
from strata_tui.widgets.view_bound import ViewBound

_STATE_STYLE = {"ready": "bold green", "starting": "yellow", "loading": "yellow", "exited": "bold red",
                "stopping": "yellow", "not started": "dim", "attaching": "yellow"}
SEPARATOR = (" · ", "dim")


def status_text(view: ViewState, width: int | None = None) -> Text:
    """The line; wider than `width` cells, it goes without the engine's URL, then without "telemetry live"
    (both only while all is well): on a narrow terminal the line's end, the latest note and the scenario's
    progress, says more."""
    for with_url, with_live in ((True, True), (False, True), (False, False)):
        text = _status_text(view, with_url, with_live)
        if width is None or text.cell_len <= width:
            break
    return text


def _status_text(view: ViewState, with_url: bool, with_live: bool) -> Text:
    parts: list[Text] = []
    if view.attached:
        parts.append(Text.assemble(("attached", "bold cyan"), (" to ", "dim"), (view.attach_url or "", "underline")))
    else:
        parts.append(Text.assemble(("profile ", "dim"), (view.profile_name, "bold")))
        parts.append(Text(view.mode, style="dim"))
    state = view.monitor.engine_state
    if view.unreachable_since is not None:
        # Not "ready": an engine that does not answer is not ready, whatever it said last. The reason is
        # shown only while it holds (a recovered engine carries no old timeout).
        clock = time.strftime("%H:%M:%S", time.localtime(view.unreachable_since))
        why = f" ({view.unreachable_reason})" if view.unreachable_reason else ""
        parts.append(Text.assemble(("engine ", "dim"), (f"unreachable since {clock}", "bold red"), (why, "red")))
    else:
        parts.append(Text.assemble(("engine ", "dim"), (state, _STATE_STYLE.get(state, ""))))
    if with_url and view.engine_url and not view.attached:
        parts.append(Text(view.engine_url, style="underline"))
    if view.unreachable_since is None and view.telemetry_connected is not None and (
            with_live or not view.telemetry_connected):
        why = "" if view.telemetry_connected or not view.telemetry_reason else f" ({view.telemetry_reason})"
        parts.append(Text.assemble(("telemetry ", "dim"), ("live", "green") if view.telemetry_connected
                                   else ("reconnecting", "yellow"), (why, "yellow")))
    # The latest note before the scenario's progress: on a narrow line the end is cut, and a refusal ("load
    # seed is still running") says more than the progress it refers to.
    if view.status_note:
        parts.append(Text(view.status_note, style="italic"))
    if view.load_running and view.load_progress:
        parts.append(Text(view.load_progress, style="cyan"))
    return Text(" · ", style="dim").join(parts)


class StatusBar(ViewBound, Static):
    """Where the app stands, drawn from the view state on every tick that has something new."""

    DEFAULT_CSS = """
    StatusBar { height: 1; padding: 0 1; background: $boost; }
    """

    _shown: Text | None = None

    def redraw(self, force: bool = False) -> None:
        view = self.changed_view(force)
        if view is not None:
            self.show(view)  # the line is most of the view: `show` compares the text it makes instead

    def show(self, view: ViewState) -> None:
        text = status_text(view, self.content_size.width or None)
        if text != self._shown:  # an unchanged line is not laid out and painted again
            self._shown = text
            self.update(text, layout=False)  # one line, always: nothing to lay out again
