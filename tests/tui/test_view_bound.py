"""Each live panel of the monitor reads its own slice of the app's ViewState on its own tick: mounted in a bare
App, with no monitor screen to pass anything down, a panel handed the view shows what the reducer folded into it,
and a tick where its slice did not change does not draw it again."""

from __future__ import annotations

from typing import Callable

import pytest
from textual.app import App
from textual.widget import Widget

from engine.snapshot import ExpertCacheSnapshot
from engine.switches import SWITCHES
from engine.telemetry import GraphEvent, SwitchEvent, VramEvent, WarningEvent
from strata_tui.adapters.view import EndpointView, ForeignView
from strata_tui.engine_io.gpu import GpuSample
from strata_tui.engine_io.messages import (EngineExited, EngineOutput, EngineReady, ExpertsSnapshot, GpuSampled,
                                           LoadProgress, TelemetryBatch)
from strata_tui.state.reducer import reduce
from strata_tui.state.view_state import ViewState
from strata_tui.widgets.crash_panel import CrashPanel
from strata_tui.widgets.engine_log import EngineLog
from strata_tui.widgets.engine_panel import EnginePanel
from strata_tui.widgets.expert_panel import ExpertPanel
from strata_tui.widgets.gpu_panel import GpuPanel
from strata_tui.widgets.graph_events import GraphEventsTable
from strata_tui.widgets.load_result import LoadResultPanel
from strata_tui.widgets.status_bar import StatusBar
from strata_tui.widgets.switches_panel import SwitchesPanel
from tests.tui.conftest import screen_text, wait_for

_SWITCH = next(sw.name for sw in SWITCHES if not sw.moe_only)


def _fold(*messages) -> Callable[[ViewState], None]:
    def feed(view: ViewState) -> None:
        for message in messages:
            reduce(view, message, 0.0, 0.0)
    return feed


def _foreign(view: ViewState) -> None:  # another engine's readings, as the app's foreign reader stores them
    view.kind = "vllm"
    view.foreign = ForeignView("vllm", [EndpointView("http://10.0.0.7:8000", "vllm", reachable=True, version="0.9",
                                                     running=3.0, waiting=1.0)])
    view.changed()


# (panel, what feeds the view, what the screen then shows)
PANELS = {
    "status bar": (StatusBar, _fold(EngineReady("http://127.0.0.1:8123")), ["engine ready", "127.0.0.1:8123"]),
    "gpus": (GpuPanel, _fold(GpuSampled([GpuSample(0, "NVIDIA H200", 1024.0, 143771.0, 87.0, 61.0, None)]),
                             TelemetryBatch([VramEvent(device="cuda:0", total_mib=143771.0, weights_mib=9000.0,
                                                       free_mib=100000.0, reserve_mib=512.0, seq=1)])),
             ["GPU0", "NVIDIA H200", "weights"]),
    "switches": (SwitchesPanel, _fold(TelemetryBatch([SwitchEvent(name=_SWITCH, state="degraded",
                                                                  reason="kernel failed", seq=1)])),
                 [f"{_SWITCH:<14} degraded: kernel failed"]),
    "experts": (ExpertPanel, _fold(ExpertsSnapshot(ExpertCacheSnapshot(slots=8, target_slots=8, num_experts=64,
                                                                       num_layers=2, expert_mib=4.0, mib=72.0))),
                ["slots 8/64"]),
    "graph events": (GraphEventsTable, _fold(TelemetryBatch([GraphEvent(action="fail", kind="decode", key="b8",
                                                                        error="out of memory", seq=1),
                                                             WarningEvent(where="tier", message="shrunk", seq=2)])),
                     ["fail", "out of memory", "last warning: tier: shrunk"]),
    "engine log": (EngineLog, _fold(EngineOutput([("stderr", "Traceback: the kernel broke")])),
                   ["Traceback: the kernel broke"]),
    "crash": (CrashPanel, _fold(EngineExited(3, requested=False, error="CUDA error: out of memory")),
              ["exited with exit code 3", "CUDA error: out of memory"]),
    "load result": (LoadResultPanel, _fold(LoadProgress("seed: 12 requests ok\nttft p50 0.4 s", done=True)),
                    ["seed: 12 requests ok", "ttft p50 0.4 s"]),
    "foreign engine": (EnginePanel, _foreign, ["10.0.0.7:8000", "up 0.9"]),
}


class _PanelApp(App):
    """One panel handed the view state, and no screen to pass anything down to it (the graph-cache table
    bordered, as on the monitor: the last warning is on its border)."""

    CSS = "GraphEventsTable { border: round $primary; }"

    def __init__(self, panel: type[Widget]) -> None:
        super().__init__()
        self.view = ViewState(mode="launched")
        self.panel = panel

    def compose(self):
        yield self.panel(self.view)


@pytest.mark.parametrize("name", list(PANELS))
async def test_a_panel_reads_its_slice_of_the_view_state_on_its_own_tick(name: str) -> None:
    panel_type, feed, shown = PANELS[name]
    app = _PanelApp(panel_type)
    async with app.run_test(size=(160, 24)) as pilot:
        before = screen_text(app)
        assert not any(text in before for text in shown), before
        feed(app.view)
        await wait_for(pilot, lambda: all(text in screen_text(app) for text in shown), what=f"{shown} on screen")


async def test_a_quiet_tick_and_another_panels_news_do_not_draw_a_panel_again(monkeypatch) -> None:
    """The slice key: news the GPU panel does not show (a status note) moves the view's version, is looked at on
    the panel's tick, and draws nothing; a new GPU reading draws it."""
    shows = []
    show = GpuPanel.show
    monkeypatch.setattr(GpuPanel, "show", lambda self, *args: (shows.append(args), show(self, *args)))
    app = _PanelApp(GpuPanel)
    async with app.run_test(size=(160, 24)) as pilot:
        panel = app.query_one(GpuPanel)
        PANELS["gpus"][1](app.view)
        await wait_for(pilot, lambda: "NVIDIA H200" in screen_text(app), what="the GPU reading")
        drawn = len(shows)
        app.view.status_note = "a note for the status bar"
        app.view.changed()
        await wait_for(pilot, lambda: panel._seen_version == (id(app.view.monitor), app.view.version),
                       what="the panel's tick to look at the new version")
        assert len(shows) == drawn, "a change outside the panel's slice drew it again"
        reduce(app.view, GpuSampled([GpuSample(0, "NVIDIA H200", 2048.0, 143771.0, 88.0, 61.0, None)]), 0.0, 0.0)
        await wait_for(pilot, lambda: "2048/143771 MiB" in screen_text(app), what="the new reading")
        assert len(shows) == drawn + 1


async def test_a_panel_dims_when_the_engine_stops_answering() -> None:
    """What telemetry said may be old once the engine does not answer: the panel greys itself on its tick."""
    app = _PanelApp(SwitchesPanel)
    async with app.run_test(size=(160, 24)) as pilot:
        panel = app.query_one(SwitchesPanel)
        await wait_for(pilot, lambda: panel._seen_version is not None, what="the first tick")
        assert not panel.has_class("-stale")
        app.view.unreachable_since = 1.0
        app.view.changed()
        await wait_for(pilot, lambda: panel.has_class("-stale"), what="the panel drawn stale")
