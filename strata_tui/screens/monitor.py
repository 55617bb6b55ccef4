"""The monitor screen: composes the live widgets and redraws them from the app's state on a timer.

Redrawing on a tick (the profile's `[tui] refresh_s`) rather than per event bounds the app's CPU use when
the engine publishes hundreds of events a second; the tick skips all work when nothing changed. The slots
table, which the slot events feed, is handed the view state and reads its slice on its own tick of the same
interval (strata_tui/widgets/slots_table.py); a forced redraw (a resize, a test) draws it now too.
"""

from __future__ import annotations

import time
from dataclasses import astuple
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header

from engine.switches import SWITCHES
from strata_tui.widgets.crash_panel import CrashPanel
from strata_tui.widgets.load_result import LoadResultPanel
from strata_tui.widgets.engine_log import EngineLog
from strata_tui.widgets.engine_panel import EnginePanel
from strata_tui.widgets.expert_panel import ExpertPanel
from strata_tui.widgets.gpu_panel import GpuPanel
from strata_tui.widgets.graph_events import GraphEventsTable
from strata_tui.widgets.slots_table import SlotsTable
from strata_tui.widgets.status_bar import StatusBar
from strata_tui.widgets.switches_panel import SwitchesPanel
from strata_tui.monitor_state import KEYED_SWITCHES

if TYPE_CHECKING:
    from strata_tui.host import StrataHost


def _set_subtitle(widget: object, text: str) -> None:
    if widget.border_subtitle != text:  # setting it repaints the border even when it is the same
        widget.border_subtitle = text


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
    """

    def __init__(self) -> None:
        super().__init__()
        self._drawn_version = -1
        self._keys_shown = (False, False)
        self._log_written = 0
        self._slices: dict[str, object] = {}  # what each widget was last given (see _slice_changed)
        self.draws = 0
        self.last_draw_s = 0.0  # wall time of the last redraw that changed something (latency bench)

    @property
    def strata(self) -> "StrataHost":
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical():
            yield StatusBar(id="status")
            yield CrashPanel(id="crash")
            yield GpuPanel(id="gpus", classes="panel")
            yield SlotsTable(self.strata.view, lambda: self.strata.clock(), id="slots", classes="panel")
            yield EnginePanel(id="engine", classes="panel")
            with Horizontal(id="lower"):
                with Vertical(id="left"):
                    yield LoadResultPanel(id="load-result")
                    yield ExpertPanel(id="experts", classes="panel")
                    yield GraphEventsTable(id="graph", classes="panel")
                    yield EngineLog(id="log", classes="panel")
                yield SwitchesPanel(id="switches", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(GpuPanel).border_title = "GPUs"
        self.query_one(SwitchesPanel).border_title = "Switches"
        self.query_one(EngineLog).border_title = "Engine log"
        self.query_one(ExpertPanel).border_title = "Expert cache"
        self.query_one(CrashPanel).border_title = "Engine stopped"
        self._set_graph_title()
        self.set_interval(self.strata.view.settings.refresh_s, self.redraw)
        self.redraw()

    def _set_graph_title(self) -> None:
        table = self.query_one(GraphEventsTable)
        table.border_title = f"Graph cache · {table.filter_name} · f"

    def on_resize(self) -> None:
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

    def action_cycle_filter(self) -> None:
        table = self.query_one(GraphEventsTable)
        table.min_severity = (table.min_severity + 1) % 3
        self._set_graph_title()

    def redraw(self, force: bool = False) -> None:
        """Push the view state down into the widgets, if anything changed since the last draw."""
        view = self.strata.view
        if view.version == self._drawn_version and not force:
            return
        self._drawn_version = view.version
        if force:
            self._slices.clear()
        state = view.monitor
        self.query_one(StatusBar).show(view)
        # Each widget gets its slice only when that slice changed: an update lays out and paints the widget
        # again, and a tick that repainted every panel for one changed number was most of the app's CPU.
        gpus = self.query_one(GpuPanel)
        if self._slice_changed("gpus", (id(view.gpu_history.latest), view.gpu_unavailable, tuple(state.vram.items()),
                                        state.tier, gpus.content_size.width)):
            gpus.show(view.gpu_history, view.gpu_unavailable, state.vram, state.tier)
        if force:
            self.query_one(SlotsTable).redraw(force=True)
        graph = self.query_one(GraphEventsTable)
        if self._slice_changed("graph", (len(state.graph_events), state.graph_events[-1].seq
                                         if state.graph_events else 0)):
            graph.show(list(state.graph_events))
        warning = state.last_warning
        _set_subtitle(graph, f"last warning: {warning.where}: {warning.message}"[:90] if warning else "")
        # keyed by the registry's order (the number keys; a switch past the ninth has none, "·"); an
        # MoE-only switch is listed for an MoE engine, or where the profile or the engine has it on
        views = [(str(i + 1) if sw in KEYED_SWITCHES else "·", state.switches[sw.name])
                 for i, sw in enumerate(SWITCHES) if sw.name in state.switches
                 and (not sw.moe_only or state.experts is not None or state.switches[sw.name].wanted
                      or bool(state.switches[sw.name].running))]
        settings = view.settings
        steps = (settings.reserve_step_mib, settings.reserve_big_step_mib)
        if self._slice_changed("switches", (tuple((key, astuple(v)) for key, v in views), state.vram_reserve_mib,
                                            steps, view.reserve_note)):
            self.query_one(SwitchesPanel).show(views, state.vram_reserve_mib, steps, view.reserve_note)
        experts = self.query_one(ExpertPanel)
        if self._slice_changed("experts", (dict(vars(state.experts)) if state.experts is not None else None,
                                           view.expert_note)):
            experts.show(state.experts, view.expert_note)
        shown_keys = (state.experts is not None, view.load_running is not None)
        if shown_keys != self._keys_shown:  # the footer's conditional keys (experts, cancel load)
            self._keys_shown = shown_keys
            self.refresh_bindings()
        for widget in (self.query_one(SlotsTable), gpus, self.query_one(SwitchesPanel), experts):
            widget.set_class(view.stale, "-stale")
        self._write_log()
        crash = self.query_one(CrashPanel)
        if view.crash is not None:
            crash_info = view.crash
            if self._slice_changed("crash", (id(crash_info), crash_info.returncode, crash_info.error,
                                             len(crash_info.recent), crash_info.requested, crash_info.why_stopped)):
                crash.show(view.crash)
        elif crash.visible_now:
            self._slices.pop("crash", None)
            crash.hide()
        if self._slice_changed("load", view.load_result):
            self.query_one(LoadResultPanel).show(view.load_result)
        self._show_foreign()
        self.draws += 1
        self.last_draw_s = time.time()

    def _slice_changed(self, name: str, key: object) -> bool:
        """True (and remembered) when a widget's slice of the state differs from what it was last given."""
        if name in self._slices and self._slices[name] == key:
            return False
        self._slices[name] = key
        return True

    def _show_foreign(self) -> None:
        """A vLLM / SGLang / llama.cpp server: its panel replaces the Strata-only ones (slots events, graph
        cache, switches, expert cache), which such an engine cannot feed."""
        view = self.strata.view
        foreign = view.foreign is not None or view.kind != "strata"
        if foreign != self.has_class("-foreign"):
            self.set_class(foreign, "-foreign")
            self.refresh_bindings()
        panel = self.query_one(EnginePanel)
        if view.foreign is None:
            panel.hide()
            return
        panel.show(view.foreign, max(1, self.app.size.height - 26))
        panel.set_class(view.stale, "-stale")

    def _write_log(self) -> None:
        view = self.strata.view
        new = view.log_total - self._log_written
        if new <= 0:
            return
        lines = list(view.log_lines)[-min(new, len(view.log_lines)):]
        self.query_one(EngineLog).add_lines(lines)
        self._log_written = view.log_total
