"""The Strata app: wiring. It owns the engine process, the run's HTTP client and the workers; what the
screens draw lives in one ViewState (`app.view`); what the keys do lives in Controls (`app.controls`).

`create_app()` is the factory the CLI and the tests share. Data flows one way: workers post messages up;
one handler hands each to the reducer (`strata_tui/state/reducer.py`), which folds it into the ViewState and says
what to do about it; each of the monitor screen's widgets reads its own slice of the view on its own refresh
tick (strata_tui/widgets/view_bound.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from engine.switches import get_switch
from strata_tui.actions.commands import palette_commands
from strata_tui.actions.controls import DEFAULT_SCENARIO, Controls
from strata_tui.engine_io.gpu import NvmlSampler
from strata_tui.engine_io.host_stats import HostSampler
from strata_tui.engine_io.launcher import API_KEY_ENV, EngineProcess, engine_argv, engine_env
from strata_tui.engine_io.messages import EngineNews
from strata_tui.engine_io.telemetry_client import TelemetryClient, stream_telemetry
from strata_tui.engine_io.workers import (engine_callbacks, poll_state, read_state, run_engine, sample_gpus,
                                          watch_liveness)
from strata_tui.foreign_app import ForeignEngines
from strata_tui.profiles.profile import Profile, ProfileError
from strata_tui.profiles.store import ProfileStore
from strata_tui.screens.help import HelpScreen
from strata_tui.screens.monitor import MonitorScreen
from strata_tui.screens.profiles import ProfilesScreen
from strata_tui.shutdown import Shutdown
from strata_tui.state.history import sample as sample_history
from strata_tui.state.monitor_state import MonitorState
from strata_tui.state.reducer import CloseClientLater, Notify, OpenClient, RedrawNow, Resync, reduce
from strata_tui.state.view_state import ViewState
from strata_tui.terminal import HangupAwareDriver, TerminalLost


HISTORY_TICK_S = 1.0


class StrataApp(ForeignEngines, App):
    """Launches (or attaches to) strata-engine and shows it live."""

    TITLE = "Strata"
    SUB_TITLE = "engine monitor"
    CSS_PATH = Path(__file__).parent / "strata.tcss"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark,f1", "show_help", "Help"),
    ]

    def __init__(
        self,
        store: ProfileStore,
        profile_name: str | None = None,
        attach_url: str | None = None,
        launch: bool = True,
        engine_program: list[str] | None = None,
        engine_cwd: str | None = None,
        sampler_factory: Callable[[], NvmlSampler] | None = NvmlSampler,
        gpu_interval_s: float = 1.0,
        stop_timeout_s: float = 5.0,
        handle_signals: bool = False,
        attach_kind: str | None = None,
        history_interval_s: float | None = HISTORY_TICK_S,
    ) -> None:
        super().__init__()
        self.history_interval_s = history_interval_s  # None: no sampling (snapshot tests fill the history)
        self.attach_kind = attach_kind  # --kind: skip detection
        self.store = store
        self.requested_profile = profile_name
        self.launch = launch and attach_url is None
        self.engine_program = engine_program
        self.engine_cwd = engine_cwd
        self.sampler_factory = sampler_factory
        self.gpu_interval_s = gpu_interval_s
        self.stop_timeout_s = stop_timeout_s
        mode = "attached" if attach_url else ("launched" if self.launch else "offline")
        first_url = attach_url.split(",")[0].strip().rstrip("/") if attach_url else None  # several: the first's
        self.view = ViewState(mode=mode, attach_url=attach_url, engine_url=first_url,
                              gpu_unavailable=None if sampler_factory else "GPU sampling off")
        self.controls = Controls(self.view, store, self.engine_client, self.run_worker, self.notify,
                                 self.post_message)
        self.shutdown = Shutdown(self, watchdog=handle_signals)
        self.process: EngineProcess | None = None
        self.client: TelemetryClient | None = None  # one per engine run (or attachment)
        self.clock = time.monotonic  # local time for ETAs counting down (tests freeze it)
        self.host_sampler: HostSampler | None = None  # made on mount (its first reading starts the interval)

    # --- what the screens and controls read ----------------------------------------------------------

    @property
    def attach_url(self) -> str | None:
        return self.view.attach_url

    @property
    def run_id(self) -> int:
        """The current engine run (or attachment); news of earlier ones is dropped."""
        return self.view.run

    @property
    def engine_running(self) -> bool:
        return self.process is not None and self.process.running

    def engine_client(self) -> TelemetryClient | None:
        """The current run's client, or None when there is no engine to talk to."""
        if self.client is None or self.view.monitor.engine_state in ("exited", "stopping"):
            return None
        return self.client

    def api_key(self) -> str | None:
        key = self.view.profile.engine.api_key if self.view.profile is not None else None
        return key or os.environ.get(API_KEY_ENV) or None

    # --- start-up ------------------------------------------------------------------------------------

    def get_driver_class(self):
        driver = super().get_driver_class()
        # Only the real terminal driver is replaced (tests run headless; TEXTUAL_DRIVER still wins).
        return HangupAwareDriver if driver.__name__ == "LinuxDriver" else driver

    async def on_mount(self) -> None:
        self.shutdown.install_signal_handlers()
        # Off the UI thread: the files are read with a size cap and never block (profiles/files.py), but a config
        # folder on a slow or hung network mount still must not keep the app from drawing or quitting.
        opened = await asyncio.to_thread(self.store.open_initial, self.requested_profile, not self.attach_url)
        if isinstance(opened, ProfileError):
            self.view.profile_error = opened
        else:
            self._set_profile(opened)
        self.push_screen(MonitorScreen())
        self.host_sampler = HostSampler()
        if self.history_interval_s is not None:
            self.set_interval(self.history_interval_s, self.sample_history)
        if self.sampler_factory is not None:
            factory = self.sampler_factory
            self.run_worker(lambda: sample_gpus(self.post_message, self.gpu_interval_s, factory()), thread=True,
                            group="gpu", name="nvml", exit_on_error=False)
        if self.attach_url:
            self.sub_title = f"attached to {self.attach_url}"
            self.view.monitor.engine_state = "attaching"
            if not self.attach_foreign_or_detect():
                self._open_client(self.attach_url)
        elif self.view.profile_error is not None:
            self.notify(str(self.view.profile_error), title="profile not usable", severity="error", timeout=15)
            self.push_screen(ProfilesScreen())
        elif self.launch:
            self.start_engine()

    def sample_history(self) -> None:
        """One sample a second for the history panel: what the view holds now, and the engine's CPU and memory
        (its process tree when this app launched it, else the host's) when it runs on the CPU."""
        from strata_tui.state.history import on_cpu

        host = None
        if self.host_sampler is not None and on_cpu(self.view):
            pid = self.process.pid if self.process is not None and self.process.running else None
            host = self.host_sampler.read(pid if not self.attach_url else None)
        values, labels = sample_history(self.view, host)
        self.view.history.add(values, labels)

    def _set_profile(self, profile: Profile) -> None:
        self.view.profile, self.view.profile_error = profile, None
        self.view.monitor = MonitorState.for_profile(dict(profile.engine.switches), profile.engine.vram_reserve_mib)
        if not self.attach_url:
            self.sub_title = f"profile {profile.name}"
        self.view.changed()

    # --- engine process ------------------------------------------------------------------------------

    def start_engine(self) -> None:
        """Launch the engine with the profile as it is on disk now (argv, never a shell; switches and the
        API key in the environment)."""
        name = self.view.profile.name if self.view.profile else None
        if name is None:
            self.notify("no usable profile: pick or fix one in Profiles (p)", severity="error")
            return
        try:
            profile = self.store.load(name)  # a hand edit since the last read is what launches
        except ProfileError as exc:
            self.view.profile_error = exc
            self.notify(str(exc), title="not launched", severity="error", timeout=15)
            self.view.changed()
            return
        self._set_profile(profile)
        if profile.foreign is not None:
            self.start_foreign(profile)
            return
        self.view.kind, self.view.foreign = "strata", None
        self.view.run += 1
        self._close_client()
        config = profile.engine
        argv = engine_argv(config, self.engine_program)
        self.process = EngineProcess(argv, {**engine_env(config), **profile.env}, cwd=self.engine_cwd,
                                     **engine_callbacks(self.post_message, self.run_id))
        self.view.monitor.reset_for_launch()
        self.view.history.clear()
        self.view.crash, self.view.engine_url, self.view.telemetry_connected = None, None, None
        self.view.unreachable_since, self.view.unreachable_reason = None, ""
        self.view.resyncing, self.view.engine_instance, self.view.stopping_why = False, None, ""
        self.view.stderr_tail.clear()
        self.view.status_note = ""
        self.view.append_log([("tui", "$ " + " ".join(argv))])
        self.run_worker(run_engine(self.post_message, self.process, self.run_id), group="engine",
                        exclusive=True, exit_on_error=False)

    async def stop_process(self, timeout_s: float | None = None, why: str = "") -> None:
        if self.process is not None and self.process.running:
            self.process.why_stopped = why
            self.view.stopping_why = why
            self.view.monitor.engine_state = "stopping"
            self.view.changed()
            await self.process.stop(self.stop_timeout_s if timeout_s is None else timeout_s)

    def _open_client(self, url: str) -> None:
        """One HTTP client for this run: the event stream, the liveness probe and every control use it."""
        self._close_client()
        self.client = TelemetryClient(url, api_key=self.api_key())
        post = self._post_for(self.run_id)
        # Events are posted in batches of up to half a refresh interval: the screen shows them at its next refresh.
        batch_s = self.view.settings.refresh_s / 2
        self.run_worker(stream_telemetry(post, self.client, batch_s), group="telemetry", exit_on_error=False)
        self.run_worker(watch_liveness(post, self.client), group="telemetry", exit_on_error=False)
        self.run_worker(poll_state(post, self.client, busy=lambda: self.view.monitor.any_running()), group="telemetry",
                        exit_on_error=False)

    def _close_client(self) -> None:
        self.workers.cancel_group(self, "telemetry")
        if self.client is not None:
            client, self.client = self.client, None
            self.run_worker(client.aclose(), group="close-client", exit_on_error=False)

    def _end_telemetry(self, run: int) -> None:
        if run == self.run_id and not self.engine_running:
            self._close_client()

    # --- worker news: one reducer ----------------------------------------------------------------------

    def on_engine_news(self, message: EngineNews) -> None:
        """Every worker message: the reducer folds it into the view; the effects it asks for happen here."""
        for effect in reduce(self.view, message, self.clock(), time.time()):
            if isinstance(effect, OpenClient):
                if self.view.kind != "strata":  # vLLM / SGLang / llama.cpp: their own readers
                    self.open_foreign(effect.url)
                else:
                    self._open_client(effect.url)
            elif isinstance(effect, CloseClientLater):
                self.set_timer(effect.after_s, lambda run=effect.run: self._end_telemetry(run))
            elif isinstance(effect, Resync):
                self._resync()
            elif isinstance(effect, RedrawNow):
                redraw = getattr(self.screen, "redraw", None)
                if redraw is not None:
                    redraw()
            elif isinstance(effect, Notify):
                self.notify(effect.text, title=effect.title, severity=effect.severity, timeout=effect.timeout_s)

    def _resync(self) -> None:
        client = self.engine_client()
        if client is None:
            return
        client.reconnect_now()
        self.run_worker(read_state(self._post_for(self.run_id), client), group="telemetry", exit_on_error=False)

    def _post_for(self, run: int) -> Callable[[EngineNews], Any]:
        """`post` for the workers of run `run`: their news is dropped once another run is current."""

        def post(message: EngineNews) -> None:
            message.run = run
            self.post_message(message)

        return post

    # --- actions -------------------------------------------------------------------------------------

    def action_toggle_switch(self, number: int) -> None:
        self.controls.toggle_switch(number)

    def action_run_load(self, name: str = DEFAULT_SCENARIO) -> None:
        self.controls.run_load(name)

    def cycle_graph_filter(self) -> None:
        """The monitor's `f`, for the palette (which may be opened over another screen)."""
        for screen in self.screen_stack:
            if isinstance(screen, MonitorScreen):
                screen.action_cycle_filter()

    def action_cancel_load(self) -> None:
        self.controls.cancel_load(lambda: self.workers.cancel_group(self, "load"))

    def action_stop_engine(self) -> None:
        if self.attach_url:
            self.notify("attached to an engine this app did not start: stop it where it runs", severity="warning")
            return
        if not self.engine_running:
            self.notify("the engine is not running")
            return
        self.run_worker(self.stop_process(why="you pressed s"), group="control", exit_on_error=False)

    def action_restart_engine(self) -> None:
        """Stop the engine (if running) and launch it again from the profile as it is on disk."""
        if self.attach_url:
            self.notify("attached to an engine this app did not start: restart it where it runs",
                        severity="warning")
            return
        self.run_worker(self._restart(), group="control", exclusive=True, exit_on_error=False)

    async def _restart(self) -> None:
        await self.stop_process(why="restart")
        self.start_engine()

    def action_show_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_show_profiles(self) -> None:
        if not isinstance(self.screen, ProfilesScreen):
            self.push_screen(ProfilesScreen())

    async def action_quit(self) -> None:
        self.shutdown.quit()

    def on_terminal_lost(self, _message: TerminalLost) -> None:
        self.shutdown.hang_up()

    def on_unmount(self) -> None:
        if self.process is not None and self.process.running and not self.process.handed_off:
            self.process.kill_now()

    # --- profiles ------------------------------------------------------------------------------------

    def use_profile(self, profile: Profile) -> None:
        """Make `profile` the current one (and the last used); relaunch the engine with it."""
        self.store.set_last_used(profile.name)
        self._set_profile(profile)
        self.notify(f"using profile {profile.name}")
        if self.launch:
            self.action_restart_engine()

    def profile_saved(self, profile: Profile) -> None:
        """The editor saved a profile; if it is the current one, take its settings."""
        if self.view.profile is None or profile.name != self.view.profile.name:
            return
        self.view.profile = profile
        for name, view in self.view.monitor.switches.items():
            view.wanted = bool(profile.engine.switches.get(name, get_switch(name).default))
        if self.engine_running:
            self.notify("saved: engine options apply at the next restart (r)")
        self.view.changed()

    def profile_renamed(self, old: str, new: str) -> None:
        if self.view.profile is not None and self.view.profile.name == old:
            self.view.profile = self.store.load(new)
            if not self.attach_url:
                self.sub_title = f"profile {new}"
            self.view.changed()

    # --- the command palette -------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from palette_commands(self)


def create_app(
    config_dir: Path | str | None = None,
    profile: str | None = None,
    attach_url: str | None = None,
    **options,
) -> StrataApp:
    """Build the app the CLI runs; tests call this with a temp config dir and their own options."""
    store = ProfileStore(Path(config_dir) if config_dir is not None else None)
    return StrataApp(store, profile_name=profile, attach_url=attach_url, **options)
