"""The command palette's entries (ctrl+p): every action, each VRAM reserve step, the expert-cache budget, each scenario,
every switch (those past the ninth, which have no key, too)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from textual.app import SystemCommand

from engine.switches import SWITCHES

if TYPE_CHECKING:
    from strata_tui.actions.host import StrataHost


def palette_commands(app: "StrataHost") -> Iterable[SystemCommand]:
    yield SystemCommand("Restart engine", "Stop the engine and launch it again from the profile",
                        app.action_restart_engine)
    yield SystemCommand("Stop engine", "SIGTERM the engine's process group", app.action_stop_engine)
    yield SystemCommand("Profiles", "List, create, edit, rename, delete profiles", app.action_show_profiles)
    yield SystemCommand("Help", "Keys and switches", app.action_show_help)
    yield SystemCommand("Filter graph events", "Cycle all / warnings and errors / errors only (f)",
                        app.cycle_graph_filter)
    yield SystemCommand("Cancel load", "Stop the running load scenario (c)", app.action_cancel_load)
    yield SystemCommand("Quit", "Stop the engine it launched and exit (q)", app.action_quit)
    for step, large in ((1, False), (-1, False), (1, True), (-1, True)):
        label = f"VRAM reserve {'up' if step > 0 else 'down'}{' (large step)' if large else ''}"
        yield SystemCommand(label, "Retune the reserve live and save it to the profile",
                            lambda s=step, big=large: app.controls.reserve(s, big))
    if app.view.monitor.experts is not None:  # MoE engines only
        for step in (1, -1):
            yield SystemCommand(f"Expert cache {'up' if step > 0 else 'down'}",
                                "One slot per layer, live, saved to the profile as expert_cache_mib",
                                lambda s=step: app.controls.expert_budget(s))
    from engine.loadgen.scenarios import SCENARIOS

    for name, scenario in SCENARIOS.items():
        yield SystemCommand(f"Load: {name}", scenario.description, lambda n=name: app.action_run_load(n))
    for index, sw in enumerate(SWITCHES):  # past the ninth too: those have no key
        yield SystemCommand(f"Toggle {sw.name}", sw.description,
                            lambda i=index + 1: app.action_toggle_switch(i))
