"""Graph-cache events (capture, evict, retry, wait, fail, degrade) with kind, MiB, time and the real error
string, colored by severity and filtered by a minimum severity; the engine's last warning on the bottom border.
Handed the app's view state, the table reads them on its own tick (widgets/view_bound.py)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from engine.telemetry import GraphEvent
from strata_tui.state.monitor_state import graph_severity
from strata_tui.state.view_state import ViewState
from strata_tui.widgets.view_bound import ViewBound

SEVERITY_STYLE = ("", "yellow", "bold red")
COLUMNS = (("time", "time"), ("action", "action"), ("kind", "kind"), ("key", "key"), ("MiB", "mib"),
           ("ms", "ms"), ("error", "error"), ("device", "device"))


def graph_cells(event: GraphEvent) -> list[Text]:
    style = SEVERITY_STYLE[graph_severity(event)]
    clock = time.strftime("%H:%M:%S", time.localtime(event.ts)) if event.ts else ""
    values = (clock, event.action, event.kind, event.key[:20], f"{event.mib:.1f}", f"{event.ms:.1f}",
              event.error or "", event.device)
    return [Text(v, style=style) for v in values]


class GraphEventsTable(ViewBound, DataTable):
    """Newest events at the bottom; `min_severity` (0 info, 1 warning, 2 error) hides the quieter ones."""

    DEFAULT_CSS = """
    GraphEventsTable { height: 1fr; min-height: 5; }
    """

    min_severity: reactive[int] = reactive(0, init=False)
    """Show events at or above this severity (0 all, 1 warnings and errors, 2 errors only)."""

    def __init__(self, view: ViewState | None = None, **kwargs) -> None:
        super().__init__(view, cursor_type="row", **kwargs)
        self._shown: list[int] = []  # seq of each row, oldest first
        self._events: list[GraphEvent] = []

    @property
    def filter_name(self) -> str:
        return ("all", "warnings+", "errors")[self.min_severity]

    def on_mount(self) -> None:
        for label, key in COLUMNS:
            self.add_column(label, key=key)

    def redraw(self, force: bool = False) -> None:
        """Match the rows to the state's graph events when a new one came (or one aged out); the last warning
        under the table."""
        view = self.changed_view(force)
        if view is None:
            return
        state = view.monitor
        events = state.graph_events
        if self.slice_changed((len(events), events[-1].seq if events else 0), force):
            self.show(list(events))
        warning = state.last_warning
        subtitle = f"last warning: {warning.where}: {warning.message}"[:90] if warning else ""
        if self.border_subtitle != subtitle:  # setting it repaints the border even when it is the same
            self.border_subtitle = subtitle

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

