"""What the screens, the command palette and the shutdown path need from the app, as a protocol: they are
handed the running StrataApp, but depend on this list rather than on `strata_tui.app`, which imports them
(a screen typed against the app module made an import circle, TYPE_CHECKING or not)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from strata_tui.actions.controls import Controls
from strata_tui.engine_io.launcher import EngineProcess
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.state.view_state import ViewState


class StrataHost(Protocol):
    view: ViewState
    store: ProfileStore
    controls: Controls
    clock: Callable[[], float]
    process: EngineProcess | None
    stop_timeout_s: float  # SIGTERM to SIGKILL for a stop nobody waits on
    # the Textual App's own, used by the shutdown path
    screen: Any
    workers: Any
    _driver: Any

    @property
    def engine_running(self) -> bool: ...

    def use_profile(self, profile: Profile) -> None: ...

    def profile_saved(self, profile: Profile) -> None: ...

    def profile_renamed(self, old: str, new: str) -> None: ...

    async def stop_process(self, timeout_s: float | None = None, why: str = "") -> None: ...

    def run_worker(self, work: Any, **kwargs: Any) -> Any: ...

    def exit(self, result: Any = None, return_code: int = 0, message: Any = None) -> None: ...

    def action_restart_engine(self) -> None: ...

    def action_stop_engine(self) -> None: ...

    def action_show_profiles(self) -> None: ...

    def action_show_help(self) -> None: ...

    def action_run_load(self, name: str = ...) -> None: ...

    def action_toggle_switch(self, number: int) -> None: ...

    def action_cancel_load(self) -> None: ...

    async def action_quit(self) -> None: ...

    def cycle_graph_filter(self) -> None: ...
