"""The engine's stdout/stderr: ANSI-safe (escape codes become styles, never raw bytes) and bounded."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

MAX_LOG_LINES = 2000


class EngineLog(RichLog):
    """A bounded log of engine output; stderr lines are tinted so errors stand out."""

    DEFAULT_CSS = """
    EngineLog { height: 1fr; min-height: 4; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=MAX_LOG_LINES, wrap=False, markup=False, highlight=False, **kwargs)
        self.lines_written = 0

    def add_lines(self, lines: list[tuple[str, str]]) -> None:
        """Append (stream, line) pairs."""
        for stream, line in lines:
            text = Text.from_ansi(line)
            if stream == "stderr" and not text.spans:
                text.stylize("yellow" if "warning" in line.lower() else "")
                if "error" in line.lower() or "traceback" in line.lower():
                    text.stylize("red")
            self.write(text)
            self.lines_written += 1
