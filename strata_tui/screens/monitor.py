"""The monitor screen: composes the live widgets, each handed the app's view state, and binds the keys.

Each widget reads its own slice of the view state on the screen's one tick of the profile's `[tui] refresh_s`
(strata_tui/widgets/view_bound.py): redrawing on a tick rather than per event bounds the app's CPU use when the
engine publishes hundreds of events a second, and a tick where a widget's slice did not change does nothing.
What is the screen's own, on a tick of the same interval: the footer's conditional keys and the panels shown for
another engine kind. A forced redraw (a resize, a test) draws every widget now.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from strata_tui.screens.dialogs import FilterDialog
from strata_tui.state.monitor_state import KEYED_SWITCHES
from strata_tui.widgets.crash_panel import CrashPanel
from strata_tui.widgets.engine_log import EngineLog, plain, save_log
from strata_tui.widgets.engine_panel import EnginePanel
from strata_tui.widgets.expert_panel import ExpertPanel
from strata_tui.widgets.gpu_panel import GpuPanel
from strata_tui.widgets.graph_events import GraphEventsTable
from strata_tui.widgets.history_panel import HistoryPanel
from strata_tui.widgets.load_result import LoadResultPanel
from strata_tui.widgets.slot_cells import MAX_SLOT_ROWS
from strata_tui.widgets.slots_table import SlotsTable
from strata_tui.widgets.status_bar import StatusBar
from strata_tui.widgets.switches_panel import SwitchesPanel
from strata_tui.widgets.view_bound import ViewBound

if TYPE_CHECKING:
    from strata_tui.actions.host import StrataHost


_EXPERT_KEYS = Binding.Group("Experts", compact=True)


def _switch_bindings() -> list[Binding]:
    return [
        Binding(str(i + 1), f"app.toggle_switch({i + 1})", f"Toggle {sw.name}", show=False)
        for i, sw in enumerate(KEYED_SWITCHES)
    ]


class MonitorScreen(Screen):
    """GPUs, slots, graph-cache events, switches and reserve, the engine log, and the crash panel."""

    BINDINGS = [
        # The essentials first: a narrow footer cuts from the right (at 80x24 it lost q and ?, the app's own).
        Binding("q", "app.quit", "Quit"),
        Binding("question_mark", "app.show_help", "Help", key_display="?"),
        Binding("l", "app.run_load", "Load"),
        Binding("c", "cancel_load", "Cancel load"),  # in the footer only while a scenario runs (check_action)
        Binding("r", "app.restart_engine", "Restart"),
        Binding("s", "app.stop_engine", "Stop"),
        Binding("f", "cycle_filter", "Filter"),
        Binding("escape", "close_result", "Close result", show=False),
        Binding("p", "app.show_profiles", "Profiles"),
        Binding("z", "zoom_history", "Zoom"),
        Binding("v", "next_pane", "Next panel", show=False),
        Binding("slash", "filter_log", "Filter log", key_display="/"),
        Binding("space", "pause_log", "Pause log", show=False),
        Binding("y", "copy_line", "Copy line", show=False),
        Binding("e", "copy_error", "Copy error", show=False),
        Binding("w", "save_log", "Save log", show=False),
        Binding("plus,equals_sign", "reserve(1, False)", "Reserve +"),
        Binding("minus", "reserve(-1, False)", "Reserve -"),
        Binding("right_square_bracket", "reserve(1, True)", "Reserve ++", show=False),
        Binding("left_square_bracket", "reserve(-1, True)", "Reserve --", show=False),
        # Shown in the footer (one entry for both) only while the engine has an expert cache (check_action).
        Binding("greater_than_sign", "expert_budget(1)", "Experts +", group=_EXPERT_KEYS),
        Binding("less_than_sign", "expert_budget(-1)", "Experts -", group=_EXPERT_KEYS),
        *_switch_bindings(),
    ]

    # The top panels take what they need (the slots at most 16 rows); the rest goes to the lower area:
    # graph-cache events over the engine log on the left (each 1fr: they shrink first on a short terminal)
    # and the switches with the reserve on the right, which never shrinks below its content.
    DEFAULT_CSS = """
    MonitorScreen .panel { border: round $primary-darken-2; border-title-color: $text-accent; }
    MonitorScreen #lower { height: 1fr; min-height: 8; }
    MonitorScreen #left { width: 1fr; }
    MonitorScreen GraphEventsTable { height: 1fr; min-height: 3; }
    MonitorScreen EngineLog { height: 1fr; min-height: 3; }
    MonitorScreen SwitchesPanel { width: 46%; max-width: 60; min-width: 44; height: 100%; }
    MonitorScreen CrashPanel { border: heavy $error; }
    MonitorScreen.-foreign SlotsTable, MonitorScreen.-foreign GraphEventsTable,
    MonitorScreen.-foreign SwitchesPanel, MonitorScreen.-foreign ExpertPanel { display: none; }
    MonitorScreen HistoryPanel { height: auto; max-height: 1fr; }
    MonitorScreen #pane-hint { height: 1; color: $text-muted; display: none; }
    MonitorScreen.-hiding #pane-hint { display: block; }
    MonitorScreen .-dropped { display: none; }
    MonitorScreen.-tiny SlotsTable { max-height: 6; }
    MonitorScreen.-tiny Header { display: none; }
    MonitorScreen.-tiny SwitchesPanel { border-top: none; padding-top: 0; }
    """
    # What the lower left shows at each height (the rest is dropped, and the hint line says so and how to see it):
    # 40 rows and more: graph cache, history and log; from 30: one of graph cache / history above the log; below
    # 30 (80x24): one panel, so the switches keep their rows.
    TALL_FROM, SHORT_FROM = 40, 30
    PANES = ("history", "graph", "log")
    PANE_NAMES = {"history": "history", "graph": "graph cache", "log": "engine log"}

    ticks_view_bound = True  # the view-bound widgets on this screen redraw on its tick (widgets/view_bound.py)

    def __init__(self) -> None:
        super().__init__()
        self._drawn_version = -1
        self._keys_shown = (False, False)
        self.pane: str | None = None  # below 40 rows: the lower left's panel the user chose with v (None: default)

    @property
    def strata(self) -> "StrataHost":
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        view = self.strata.view
        yield Header()
        with Vertical():
            yield StatusBar(view, id="status")
            yield CrashPanel(view, id="crash")
            yield GpuPanel(view, id="gpus", classes="panel")
            yield SlotsTable(view, lambda: self.strata.clock(), id="slots", classes="panel")
            yield EnginePanel(view, id="engine", classes="panel")
            with Horizontal(id="lower"):
                with Vertical(id="left"):
                    yield LoadResultPanel(view, id="load-result")
                    yield ExpertPanel(view, id="experts", classes="panel")
                    yield GraphEventsTable(view, id="graph", classes="panel")
                    yield HistoryPanel(view, id="history", classes="panel")
                    yield EngineLog(view, id="log", classes="panel")
                    yield Static("", id="pane-hint")
                yield SwitchesPanel(view, id="switches", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(GpuPanel).border_title = "GPUs"
        self.query_one(SwitchesPanel).border_title = "Switches"
        self.query_one(ExpertPanel).border_title = "Expert cache"
        self.query_one(CrashPanel).border_title = "Engine stopped"
        self._set_graph_title()
        self.lay_out()
        self.set_interval(self.strata.view.settings.refresh_s, self._tick)
        self._draw_own()

    def _tick(self) -> None:
        """One timer for the screen and every view-bound widget on it (`ticks_view_bound`): each looks at its slice
        of the view (a few attribute reads when nothing moved) and draws only what changed."""
        self.redraw()

    def _set_graph_title(self) -> None:
        table = self.query_one(GraphEventsTable)
        table.border_title = f"Graph cache · {table.filter_name} · f"

    def on_resize(self) -> None:
        self.lay_out()
        self.redraw(force=True)

    def shown_panes(self) -> list[str]:
        """The lower-left panels this terminal's height leaves room for (of history, graph cache, log)."""
        height = self.app.size.height
        strata = self.strata.view.kind == "strata"
        candidates = [p for p in self.PANES if strata or p != "graph"]  # another kind has no graph cache
        if height >= self.TALL_FROM:
            return candidates
        if height >= self.SHORT_FROM:
            pane = self.pane if self.pane in candidates and self.pane != "log" else "history"
            return [pane, "log"]
        return [self.pane if self.pane in candidates else "log"]  # the log first: what the engine says

    def lay_out(self) -> None:
        """Drop what does not fit, and say on the hint line what was dropped and which key shows it."""
        height = self.app.size.height
        self.set_class(height < self.SHORT_FROM, "-tiny")
        shown = self.shown_panes()
        widgets = {"history": HistoryPanel, "graph": GraphEventsTable, "log": EngineLog}
        hidden = []
        for pane, kind in widgets.items():
            dropped = pane not in shown
            self.query_one(kind).set_class(dropped, "-dropped")
            if dropped and (pane != "graph" or self.strata.view.kind == "strata"):
                hidden.append(self.PANE_NAMES[pane])
        self.set_class(bool(hidden), "-hiding")
        hint = self.query_one("#pane-hint", Static)
        hint.update(f"v shows: {', '.join(hidden)}" if hidden else "")
        # below 30 rows the switches keep their rows: the slots table shows the busiest three and counts the rest
        self.query_one(SlotsTable).row_limit = 3 if height < self.SHORT_FROM else MAX_SLOT_ROWS

    def action_next_pane(self) -> None:
        """v: the next of the panels a short terminal leaves out, in place of the one shown."""
        candidates = [p for p in self.PANES if self.strata.view.kind == "strata" or p != "graph"]
        if self.app.size.height >= self.TALL_FROM:
            self.notify("every panel is shown at this size")
            return
        if self.app.size.height >= self.SHORT_FROM:
            candidates = [p for p in candidates if p != "log"]
            current = self.shown_panes()[0]
        else:
            current = self.shown_panes()[0]
        self.pane = candidates[(candidates.index(current) + 1) % len(candidates)]
        self.lay_out()
        self.redraw(force=True)

    def action_close_result(self) -> None:
        view = self.strata.view
        if view.load_result is not None:
            view.load_result = None
            view.changed()
            self.redraw()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "expert_budget":  # a dense model has no expert cache: no keys for one
            return self.strata.view.monitor.experts is not None
        if action == "cancel_load":
            return self.strata.view.load_running is not None
        if action in ("cycle_filter", "reserve"):  # the graph-cache events and the VRAM reserve are Strata's
            return self.strata.view.kind == "strata"
        return True

    def action_cancel_load(self) -> None:
        self.strata.action_cancel_load()

    def action_reserve(self, direction: int, large: bool = False) -> None:
        self.strata.controls.reserve(direction, large)

    def action_expert_budget(self, direction: int) -> None:
        self.strata.controls.expert_budget(direction)

    # --- the engine log: filter, pause, copy, save -------------------------------------------------------------

    def action_filter_log(self) -> None:
        log = self.query_one(EngineLog)

        def apply(pattern: str | None) -> None:
            if pattern is not None:
                log.set_filter(pattern)

        self.app.push_screen(FilterDialog(log.pattern), apply)

    def action_pause_log(self) -> None:
        self.query_one(EngineLog).toggle_pause()

    def action_copy_line(self) -> None:
        line = self.query_one(EngineLog).current_line()
        if line is None:
            self.notify("the engine log is empty: nothing to copy", severity="warning")
            return
        self.app.copy_to_clipboard(line)
        self.notify(f"copied: {line[:120]}", title="clipboard (OSC 52)")

    def action_copy_error(self) -> None:
        error = self.strata.view.last_error_text()
        if not error:
            self.notify("no error so far: nothing to copy", severity="warning")
            return
        self.app.copy_to_clipboard(error)
        self.notify(f"copied: {error[:120]}", title="clipboard (OSC 52)")

    def action_save_log(self) -> None:
        log = self.query_one(EngineLog)
        lines = [plain(line) for line in log.shown]
        name = self.strata.view.profile_name

        def write() -> Path:
            return save_log(lines, name)

        async def save() -> None:
            try:
                path = await asyncio.to_thread(write)
            except OSError as exc:
                self.notify(f"log not saved: {exc}", severity="error", timeout=10)
                return
            what = f"{len(lines):,} lines" + (f" matching {log.pattern!r}" if log.pattern else "")
            self.notify(f"saved {what} to {path}", title="engine log", timeout=10)

        self.run_worker(save(), group="save-log", exit_on_error=False)

    def action_zoom_history(self) -> None:
        self.query_one(HistoryPanel).zoom()

    def action_cycle_filter(self) -> None:
        table = self.query_one(GraphEventsTable)
        table.min_severity = (table.min_severity + 1) % 3
        self._set_graph_title()

    def redraw(self, force: bool = False) -> None:
        """Draw now, not on the next ticks: every widget's slice that changed (all of them, `force`), and the
        screen's own bits."""
        for widget in self.walk_children():
            if isinstance(widget, ViewBound):
                widget.redraw(force)  # type: ignore[attr-defined]
        self._draw_own(force)

    def _draw_own(self, force: bool = False) -> None:
        """The footer's conditional keys and the panels shown for another engine kind, when the view moved."""
        view = self.strata.view
        if view.version == self._drawn_version and not force:
            return
        self._drawn_version = view.version
        shown_keys = (view.monitor.experts is not None, view.load_running is not None)
        if shown_keys != self._keys_shown:  # the footer's conditional keys (experts, cancel load)
            self._keys_shown = shown_keys
            self.refresh_bindings()
        # A vLLM / SGLang / llama.cpp server: its panel replaces the Strata-only ones (slots events, graph cache,
        # switches, expert cache), which such an engine cannot feed.
        foreign = view.kind != "strata"  # (a Strata engine keeps its panels beside other endpoints' rows)
        if foreign != self.has_class("-foreign"):
            self.set_class(foreign, "-foreign")
            self.refresh_bindings()
            self.lay_out()
