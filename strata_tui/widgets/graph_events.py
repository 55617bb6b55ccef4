"""Graph-cache events (capture, evict, retry, wait, fail, degrade) with kind, MiB, time and the real error
string, colored by severity and filtered by a minimum severity."""

from __future__ import annotations

import time

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from engine.telemetry import GraphEvent
from strata_tui.monitor_state import graph_severity

SEVERITY_STYLE = ("", "yellow", "bold red")
COLUMNS = (("time", "time"), ("action", "action"), ("kind", "kind"), ("key", "key"), ("MiB", "mib"),
           ("ms", "ms"), ("error", "error"), ("device", "device"))


def graph_cells(event: GraphEvent) -> list[Text]:
    style = SEVERITY_STYLE[graph_severity(event)]
    clock = time.strftime("%H:%M:%S", time.localtime(event.ts)) if event.ts else ""
    values = (clock, event.action, event.kind, event.key[:20], f"{event.mib:.1f}", f"{event.ms:.1f}",
              event.error or "", event.device)
    return [Text(v, style=style) for v in values]


class GraphEventsTable(DataTable):
    """Newest events at the bottom; `min_severity` (0 info, 1 warning, 2 error) hides the quieter ones."""

    DEFAULT_CSS = """
    GraphEventsTable { height: 1fr; min-height: 5; }
    """

    min_severity: reactive[int] = reactive(0, init=False)
    """Show events at or above this severity (0 all, 1 warnings and errors, 2 errors only)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self._shown: list[int] = []  # seq of each row, oldest first
        self._events: list[GraphEvent] = []

    @property
    def filter_name(self) -> str:
        return ("all", "warnings+", "errors")[self.min_severity]

    @property
    def shown_count(self) -> int:
        return len(self._shown)

    def on_mount(self) -> None:
        for label, key in COLUMNS:
            self.add_column(label, key=key)

    def watch_min_severity(self) -> None:
        self.clear()
        self._shown = []
        self._append(self._events)

    def show(self, events: list[GraphEvent]) -> None:
        """Match the table to `events` (the state's bounded ring, oldest first): append new, drop aged-out."""
        self._events = list(events)
        live = {e.seq for e in self._events}
        while self._shown and self._shown[0] not in live:
            self.remove_row(str(self._shown.pop(0)))
        last = self._shown[-1] if self._shown else -1
        self._append([e for e in self._events if e.seq > last])

    def _append(self, events: list[GraphEvent]) -> None:
        added = False
        for event in events:
            if graph_severity(event) < self.min_severity or str(event.seq) in self.rows:
                continue
            self.add_row(*graph_cells(event), key=str(event.seq))
            self._shown.append(event.seq)
            added = True
        if added:
            self.move_cursor(row=self.row_count - 1, animate=False)

