"""The engine's stdout/stderr: ANSI-safe (escape codes become styles, never raw bytes) and bounded.

A line is cut, not wrapped, so a logging line leads with its message: `YYYY-MM-DD HH:MM:SS,mmm INFO
engine.server.app: ready at ...` is shown as `ready at ...  HH:MM:SS engine.server.app` (in a 50-column panel the
timestamp and the logger's name alone used to fill the line). Handed the app's view state, the log writes the
lines the view took in since its last tick (widgets/view_bound.py)."""

from __future__ import annotations

import re

from rich.text import Text
from textual.widgets import RichLog

from strata_tui.view_state import ViewState
from strata_tui.widgets.view_bound import ViewBound

MAX_LOG_LINES = 2000


# `logging`'s "%(asctime)s %(levelname)s %(name)s: %(message)s" (strata-engine serve) and uvicorn's "LEVEL:  msg"
_LOGGING_LINE = re.compile(r"^(?:\d{4}-\d{2}-\d{2}[ T])?(\d{2}:\d{2}:\d{2})(?:[,.]\d+)?\s+"
                           r"(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+([\w.\-]+):\s(.*)$")
_LEVEL_STYLE = {"WARNING": "yellow", "ERROR": "red", "CRITICAL": "bold red"}


def message_first(line: str) -> Text:
    """A logging line as its message (a warning or error says so first), then its time and logger, dimmed; any
    other line as it came (escape codes turned into styles)."""
    text = Text.from_ansi(line)
    match = _LOGGING_LINE.match(text.plain)
    if match is None:
        return text
    clock, level, logger, message = match.groups()
    out = Text()
    if level in _LEVEL_STYLE:
        out.append(f"{level} ", style=_LEVEL_STYLE[level])
    out.append(message, style=_LEVEL_STYLE.get(level, ""))
    out.append(f"  {clock} {logger}", style="dim")
    return out


class EngineLog(ViewBound, RichLog):
    """A bounded log of engine output; stderr lines are tinted so errors stand out."""

    DEFAULT_CSS = """
    EngineLog { height: 1fr; min-height: 4; }
    """

    def __init__(self, view: ViewState | None = None, **kwargs) -> None:
        super().__init__(view, max_lines=MAX_LOG_LINES, wrap=False, markup=False, highlight=False, **kwargs)
        self.lines_written = 0
        self._taken = 0  # the view's `log_total` when its lines were last written here

    def redraw(self, force: bool = False) -> None:
        """Write the lines the view took in since the last tick (those still in its bounded deque)."""
        view = self.changed_view(force)
        if view is None:
            return
        new = view.log_total - self._taken
        if new <= 0:
            return
        self.add_lines(list(view.log_lines)[-min(new, len(view.log_lines)):])
        self._taken = view.log_total

    def on_resize(self) -> None:
        """Keep following the tail when the panel changes height: the crash panel appearing shrinks the log, and
        the lines it would push out of view are the last ones the engine wrote (its traceback). A write scrolls to
        the end anyway (RichLog's auto_scroll), so a resize follows the same rule."""
        if self.auto_scroll:
            self.scroll_end(animate=False, immediate=False, x_axis=False)

    def add_lines(self, lines: list[tuple[str, str]]) -> None:
        """Append (stream, line) pairs."""
        for stream, line in lines:
            text = message_first(line)
            if stream == "stderr" and not text.spans:
                text.stylize("yellow" if "warning" in line.lower() else "")
                if "error" in line.lower() or "traceback" in line.lower():
                    text.stylize("red")
            self.write(text)
            self.lines_written += 1
