"""The engine's stdout/stderr: ANSI-safe (escape codes become styles, never raw bytes) and bounded.

A line is cut, not wrapped, so a logging line leads with its message: `YYYY-MM-DD HH:MM:SS,mmm INFO
engine.server.app: ready at ...` is shown as `ready at ...  HH:MM:SS engine.server.app` (in a 50-column panel the
timestamp and the logger's name alone used to fill the line). Handed the app's view state, the log writes the
lines the view took in since its last tick (widgets/view_bound.py)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import platformdirs

from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widgets import RichLog

from strata_tui.state.view_state import ViewState
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


def log_dir() -> Path:
    """Where `w` saves: $STRATA_TUI_LOG_DIR, else the platform's log folder for strata-tui."""
    folder = os.environ.get("STRATA_TUI_LOG_DIR")
    return Path(folder) if folder else platformdirs.user_log_path("strata-tui", appauthor=False)


def save_log(lines: list[str], profile: str) -> Path:
    """Write `lines` to a new file named after the profile and the time; returns its path (blocks: a thread's
    job)."""
    folder = log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]", "_", profile) or "engine"
    path = folder / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    suffix = 1
    while path.exists():
        suffix += 1
        path = folder / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}.log"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def plain(line: str) -> str:
    """A line as text, its escape codes dropped (what is copied and saved)."""
    return Text.from_ansi(line).plain


def compile_filter(pattern: str) -> re.Pattern[str]:
    """`/`'s pattern: a regular expression, case-insensitive; one that does not compile is matched as typed."""
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error:
        return re.compile(re.escape(pattern), re.IGNORECASE)


class EngineLog(ViewBound, RichLog):
    """A bounded log of engine output; stderr lines are tinted so errors stand out. It follows its tail; `/` shows
    only the lines that match a pattern, space pauses it (new lines wait, counted in the title; up / down move a
    cursor over the lines shown), `y` copies the cursor's line (the last line while following) and `w` saves the
    lines shown to a file."""

    DEFAULT_CSS = """
    EngineLog { height: 1fr; min-height: 4; }
    """
    BINDINGS = [("up", "cursor(-1)", "Line up"), ("down", "cursor(1)", "Line down"),
                ("pageup", "cursor(-10)", "Page up"), ("pagedown", "cursor(10)", "Page down")]

    def __init__(self, view: ViewState | None = None, **kwargs) -> None:
        super().__init__(view, max_lines=MAX_LOG_LINES, wrap=False, markup=False, highlight=False, **kwargs)
        self.lines_written = 0
        self._taken = 0  # the view's `log_total` when its lines were last written here
        self.pattern = ""  # the filter (`/`); "" shows every line
        self._match: re.Pattern[str] | None = None
        self.paused = False
        self.waiting = 0  # lines that came while paused (written on resume)
        self.shown: list[str] = []  # the lines written, as the engine wrote them (aligned with RichLog's lines)
        self.cursor: int | None = None  # while paused: the index in `shown` of the highlighted line

    def redraw(self, force: bool = False) -> None:
        """Write the lines the view took in since the last tick (those still in its bounded deque); while paused,
        count them instead."""
        view = self.changed_view(force)
        if view is None:
            return
        new = view.log_total - self._taken
        if new <= 0:
            return
        if self.paused:
            self.waiting = new
            self._set_title()
            return
        self.add_lines(list(view.log_lines)[-min(new, len(view.log_lines)):])
        self._taken = view.log_total

    def on_resize(self) -> None:
        """Keep following the tail when the panel changes height: the crash panel appearing shrinks the log, and
        the lines it would push out of view are the last ones the engine wrote (its traceback). A write scrolls to
        the end anyway (RichLog's auto_scroll), so a resize follows the same rule."""
        if self.auto_scroll and not self.paused:
            self.scroll_end(animate=False, immediate=False, x_axis=False)

    def add_lines(self, lines: list[tuple[str, str]]) -> None:
        """Append (stream, line) pairs (those the filter lets through)."""
        for stream, line in lines:
            if self._match is not None and not self._match.search(plain(line)):
                continue
            text = message_first(line)
            if stream == "stderr" and not text.spans:
                text.stylize("yellow" if "warning" in line.lower() else "")
                if "error" in line.lower() or "traceback" in line.lower():
                    text.stylize("red")
            self.write(text)
            self.shown.append(line)
            self.lines_written += 1
        if len(self.shown) > MAX_LOG_LINES:
            del self.shown[:len(self.shown) - MAX_LOG_LINES]

    # --- filter, pause, cursor, copy, save ------------------------------------------------------------------

    def set_filter(self, pattern: str) -> None:
        """Show only the lines (of those the view still holds) that match `pattern`; "" shows them all again."""
        self.pattern = pattern
        self._match = compile_filter(pattern) if pattern else None
        self.clear()
        self.shown.clear()
        self.cursor = None
        if self.view is not None:
            self.add_lines(list(self.view.log_lines))
            self._taken = self.view.log_total
            self.waiting = 0
        if self.paused:
            self.cursor = len(self.shown) - 1 if self.shown else None
        self._set_title()
        self.refresh()

    def toggle_pause(self) -> None:
        """Pause: the view stays as it is (new lines are counted), and up / down move a cursor over it. Resume:
        the lines that came meanwhile are written and the log follows its tail again."""
        self.paused = not self.paused
        self.auto_scroll = not self.paused
        if self.paused:
            self.cursor = len(self.shown) - 1 if self.shown else None
            self.focus()
        else:
            self.cursor, self.waiting = None, 0
            self.redraw(force=True)
            self.scroll_end(animate=False, x_axis=False)
        self._set_title()
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        if not self.paused or not self.shown:
            self.scroll_relative(y=delta, animate=False)
            return
        self.cursor = max(0, min(len(self.shown) - 1, (self.cursor or 0) + delta))
        top, height = self.scroll_offset.y, self.scrollable_content_region.height
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False)
        self.refresh()

    def current_line(self) -> str | None:
        """The line `y` copies: the cursor's while paused, else the last line shown."""
        if not self.shown:
            return None
        index = self.cursor if self.paused and self.cursor is not None else len(self.shown) - 1
        return plain(self.shown[index])

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        if self.cursor is not None and self.scroll_offset.y + y == self.cursor:
            strip = strip.apply_style(Style(reverse=True))
        return strip

    def _set_title(self) -> None:
        parts = ["Engine log"]
        if self.pattern:
            parts.append(f"filter {self.pattern!r}: {len(self.shown):,} lines")
        if self.paused:
            parts.append(f"paused, {self.waiting:,} new" if self.waiting else "paused")
        parts.append("/ filter · space pause · y copy · w save")
        title = " · ".join(parts)
        if self.border_title != title:
            self.border_title = title

    def on_mount(self) -> None:
        self._set_title()
