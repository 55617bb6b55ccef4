"""The Strata app: owns the profile, the monitor state and the workers; screens draw what it holds.

`create_app()` is the factory the CLI and the tests share. Data flows one way: workers (engine process,
telemetry, NVML, load) post messages up; the handlers here fold them into `monitor` and friends and bump
`view_version`; the monitor screen's refresh tick pushes the changed state down into its widgets.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from engine.switches import SWITCHES
from engine.telemetry import EngineEvent, ErrorEvent, Event
from strata_tui import controls
from strata_tui.gpu import GpuHistory, NvmlSampler
from strata_tui.launcher import EngineProcess, engine_argv, engine_env
from strata_tui.messages import (
    EngineExited,
    EngineOutput,
    EngineReady,
    GpuSampled,
    LoadProgress,
    StateSnapshot,
    TelemetryBatch,
    TelemetryStatus,
)
from strata_tui.monitor_state import MonitorState
from strata_tui.profiles import Profile, ProfileError, ProfileStore, TuiSettings
from strata_tui.screens.help import HelpScreen
from strata_tui.screens.monitor import MonitorScreen
from strata_tui.screens.profiles import ProfilesScreen
from strata_tui.telemetry_client import TelemetryClient
from strata_tui.terminal import HangupAwareDriver, TerminalLost, hard_exit
from strata_tui.workers import engine_callbacks, run_engine, sample_gpus, stream_telemetry

# How long each way of ending may take: the engine's graceful stop (SIGTERM, then SIGKILL), and the hard
# deadline after which the watchdog thread kills the engine's group and leaves whatever the loop is doing.
QUIT_STOP_S = 2.0            # `q`: returns within 3 s even when the engine ignores SIGTERM
SIGNAL_STOP_S, SIGNAL_DEADLINE_S = 2.0, 2.8
HANGUP_STOP_S, HANGUP_DEADLINE_S = 0.8, 1.5   # the terminal closed: gone within 2 s
LOG_LINES = 2000
STDERR_TAIL = 40
TELEMETRY_DRAIN_S = 1.0
# Log records below ERROR: their logger name may contain "error" (uvicorn.error) without being one.
_QUIET_RECORD = re.compile(r"\b(DEBUG|INFO|WARNING)\b")
_ERROR_LINE = re.compile(r"(\berror\b[:\s]|^\w*(Error|Exception)\b|\bCUDA error\b|\bFATAL\b|\bCRITICAL\b)",
                         re.IGNORECASE)


def pick_error_line(lines: Iterable[str]) -> str | None:
    """The engine's last stderr line that states an error; else its last stderr line; None without any."""
    tail = [line.strip() for line in lines if line.strip()]
    for line in reversed(tail):
        if _ERROR_LINE.search(line) and not _QUIET_RECORD.search(line):
            return line
    return tail[-1] if tail else None


@dataclass
class CrashInfo:
    """What the crash panel shows about the engine's end."""

    returncode: int | None
    error: str | None
    recent: list[Event]
    requested: bool


class StrataApp(controls.ControlActions, App):
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
    ) -> None:
        super().__init__()
        self.store = store
        self.requested_profile = profile_name
        self.attach_url = attach_url
        self.launch = launch and attach_url is None
        self.engine_program = engine_program
        self.engine_cwd = engine_cwd
        self.sampler_factory = sampler_factory
        self.gpu_interval_s = gpu_interval_s
        self.stop_timeout_s = stop_timeout_s
        self.handle_signals = handle_signals
        self.profile: Profile | None = None
        self.profile_error: ProfileError | None = None
        self.monitor = MonitorState.for_profile({}, 0)
        self.gpu_history = GpuHistory()
        self.gpu_unavailable: str | None = None if sampler_factory else "GPU sampling off"
        self.log_lines: deque[tuple[str, str]] = deque(maxlen=LOG_LINES)
        self.log_total = 0
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.engine_url: str | None = attach_url
        self.telemetry_connected: bool | None = None
        self.status_note = ""
        self.reserve_note = ""
        self.crash: CrashInfo | None = None
        self.process: EngineProcess | None = None
        self.run_id = 0
        self._changes = 0
        self._quitting: str | None = None  # why the app is ending, once it is

    # --- what the screens read -----------------------------------------------------------------------

    @property
    def view_version(self) -> int:
        return self.monitor.version + self._changes

    @property
    def profile_name(self) -> str:
        if self.profile is not None:
            return self.profile.name
        return self.profile_error.path.stem if self.profile_error else "(none)"

    @property
    def profile_settings(self) -> TuiSettings:
        return self.profile.tui if self.profile is not None else TuiSettings()

    @property
    def mode_label(self) -> str:
        return "attached" if self.attach_url else ("launched" if self.launch else "offline")

    @property
    def engine_running(self) -> bool:
        return self.process is not None and self.process.running

    def changed(self) -> None:
        self._changes += 1

    # --- start-up ------------------------------------------------------------------------------------

    def get_driver_class(self):
        driver = super().get_driver_class()
        # Only the real terminal driver is replaced (tests run headless; TEXTUAL_DRIVER still wins).
        return HangupAwareDriver if driver.__name__ == "LinuxDriver" else driver

    def on_mount(self) -> None:
        if self.handle_signals:
            # The engine runs in its own session, so a signal to us does not reach it: end the way `q`
            # does (stop the engine first), within a deadline. A second SIGTERM/SIGINT ends it at once.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, lambda s=sig: self.request_quit(
                    s.name, SIGNAL_STOP_S, 128 + s, deadline_s=SIGNAL_DEADLINE_S, force_if_repeated=True))
            loop.add_signal_handler(signal.SIGHUP, self._hang_up)
        opened = self.store.open_initial(self.requested_profile)
        if isinstance(opened, ProfileError):
            self.profile_error = opened
        else:
            self._set_profile(opened)
        self.push_screen(MonitorScreen())
        if self.sampler_factory is not None:
            factory = self.sampler_factory
            self.run_worker(lambda: sample_gpus(self, self.gpu_interval_s, factory()), thread=True,
                            group="gpu", name="nvml", exit_on_error=False)
        if self.profile_error is not None:
            self.notify(str(self.profile_error), title="profile not usable", severity="error", timeout=15)
            self.push_screen(ProfilesScreen())
        elif self.attach_url:
            self.monitor.engine_state = "attaching"
            self.connect_telemetry(self.attach_url)
        elif self.launch:
            self.start_engine()

    def _set_profile(self, profile: Profile) -> None:
        self.profile = profile
        self.profile_error = None
        self.monitor = MonitorState.for_profile(dict(profile.engine.switches), profile.engine.vram_reserve_mib)
        self.sub_title = f"profile {profile.name}"
        self.changed()

    # --- engine process ------------------------------------------------------------------------------

    def start_engine(self) -> None:
        """Launch the engine for the current profile (argv, never a shell; switches in the environment)."""
        if self.profile is None:
            self.notify("no usable profile: pick or fix one in Profiles (p)", severity="error")
            return
        self.run_id += 1
        self.workers.cancel_group(self, "telemetry")  # the previous run's stream must not outlive it
        config = self.profile.engine
        argv = engine_argv(config, self.engine_program)
        self.process = EngineProcess(argv, engine_env(config), cwd=self.engine_cwd,
                                     **engine_callbacks(self, self.run_id))
        self.monitor.reset_for_launch()
        self.crash, self.engine_url, self.telemetry_connected = None, None, None
        self.stderr_tail.clear()
        self.status_note = ""
        self._append_log([("tui", "$ " + " ".join(argv))])
        self.run_worker(run_engine(self, self.process, self.run_id), group="engine", exclusive=True,
                        exit_on_error=False)
        self.changed()

    async def stop_process(self, timeout_s: float | None = None) -> None:
        if self.process is not None and self.process.running:
            self.monitor.engine_state = "stopping"
            self.changed()
            await self.process.stop(self.stop_timeout_s if timeout_s is None else timeout_s)

    def connect_telemetry(self, url: str) -> None:
        api_key = self.profile.engine.api_key if self.profile else None
        client = TelemetryClient(url, api_key=api_key)
        self.run_worker(stream_telemetry(self, client), group="telemetry", exclusive=True, exit_on_error=False)

    def on_engine_output(self, message: EngineOutput) -> None:
        if message.run == self.run_id:
            self._append_log(message.lines)

    def _append_log(self, lines: Iterable[tuple[str, str]]) -> None:
        for stream, line in lines:
            self.log_lines.append((stream, line))
            self.log_total += 1
            if stream == "stderr" and line.strip():
                self.stderr_tail.append(line)
        self.changed()

    def on_engine_ready(self, message: EngineReady) -> None:
        if message.run != self.run_id:
            return
        self.engine_url = message.url
        if self.monitor.engine_state in ("starting", "loading", "not started"):
            self.monitor.engine_state = "ready"
        self.connect_telemetry(message.url)
        self.changed()

    def on_engine_exited(self, message: EngineExited) -> None:
        if message.run != self.run_id:
            return
        # The stream may still hold the engine's last events (its fatal ErrorEvent): let it drain briefly.
        run = self.run_id
        self.set_timer(TELEMETRY_DRAIN_S, lambda: self._end_telemetry(run))
        self.telemetry_connected = None
        self.monitor.note_exit(message.returncode)
        self.monitor.slots.clear()
        error = message.error or self.last_error_text()
        self.crash = CrashInfo(message.returncode, error, list(self.monitor.recent), message.requested)
        if message.error:
            self._append_log([("tui", message.error)])
        self.changed()

    def _end_telemetry(self, run: int) -> None:
        if run == self.run_id and not self.engine_running:
            self.workers.cancel_group(self, "telemetry")

    def last_error_text(self) -> str | None:
        """The real error: the engine's last ErrorEvent, else its last stderr line that says error."""
        event = self.monitor.last_error
        if event is not None:
            where = f"{event.where}: " if event.where else ""
            kind = f"{event.exc_type}: " if event.exc_type else ""
            free = f" (VRAM free {event.vram_free_mib:.0f} MiB)" if event.vram_free_mib is not None else ""
            return f"{where}{kind}{event.message}{free}"
        return pick_error_line(self.stderr_tail)

    # --- telemetry and GPU ---------------------------------------------------------------------------

    def on_telemetry_batch(self, message: TelemetryBatch) -> None:
        self.monitor.apply_all(message.events)
        if self.crash is not None and not self.attach_url:
            # Late events of a run that already exited: they may carry the real error.
            self.crash.error = self.last_error_text() or self.crash.error
            self.crash.recent = list(self.monitor.recent)
        if self.attach_url:
            for event in message.events:
                if isinstance(event, EngineEvent) and event.state == "exit":
                    self.crash = CrashInfo(event.exit_code, self.last_error_text(), list(self.monitor.recent),
                                           False)
                elif isinstance(event, EngineEvent) and event.state in ("starting", "ready"):
                    self.crash = None
                elif isinstance(event, ErrorEvent) and event.fatal:
                    self.crash = CrashInfo(None, self.last_error_text(), list(self.monitor.recent), False)

    def on_state_snapshot(self, message: StateSnapshot) -> None:
        self.monitor.apply_snapshot(message.snapshot)
        if self.attach_url and self.monitor.engine_state == "attaching":
            self.monitor.engine_state = "ready"

    def on_telemetry_status(self, message: TelemetryStatus) -> None:
        if self.crash is not None and not self.attach_url:
            return  # the engine is gone: its stream failing to reconnect is not news
        self.telemetry_connected = message.connected
        self.status_note = "" if message.connected else message.reason[:80]
        self.changed()

    def on_gpu_sampled(self, message: GpuSampled) -> None:
        self.gpu_history.add(message.samples)
        self.gpu_unavailable = message.unavailable
        self.changed()

    def on_load_progress(self, message: LoadProgress) -> None:
        self.status_note = message.text[:120]
        if message.done:
            self.notify(message.text, title="load", severity="error" if message.failed else "information",
                        timeout=10)
        self.changed()

    # --- screens and the command palette -------------------------------------------------------------

    def action_show_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_show_profiles(self) -> None:
        if not isinstance(self.screen, ProfilesScreen):
            self.push_screen(ProfilesScreen())

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Restart engine", "Stop the engine and launch it again from the profile",
                            self.action_restart_engine)
        yield SystemCommand("Stop engine", "SIGTERM the engine's process group", self.action_stop_engine)
        yield SystemCommand("Profiles", "List, create, edit, rename, delete profiles", self.action_show_profiles)
        yield SystemCommand("Help", "Keys and switches", self.action_show_help)
        for step, large in ((1, False), (-1, False), (1, True), (-1, True)):
            label = f"VRAM reserve {'up' if step > 0 else 'down'}{' (large step)' if large else ''}"
            yield SystemCommand(label, "Retune the reserve live and save it to the profile",
                                lambda s=step, big=large: self.action_reserve(s, big))
        from engine.scenarios import SCENARIOS

        for name, scenario in SCENARIOS.items():
            yield SystemCommand(f"Load: {name}", scenario.description, lambda n=name: self.action_run_load(n))
        for index, sw in enumerate(SWITCHES[:9]):
            yield SystemCommand(f"Toggle {sw.name}", sw.description,
                                lambda i=index + 1: self.action_toggle_switch(i))

    async def action_quit(self) -> None:
        self.request_quit("quit", QUIT_STOP_S, 0, deadline_s=QUIT_STOP_S + 0.8)

    def on_terminal_lost(self, _message: TerminalLost) -> None:
        self._hang_up()

    def _hang_up(self) -> None:
        self.request_quit("SIGHUP", HANGUP_STOP_S, 128 + signal.SIGHUP, deadline_s=HANGUP_DEADLINE_S)

    def request_quit(self, why: str, stop_s: float, return_code: int, deadline_s: float | None = None,
                     force_if_repeated: bool = False) -> None:
        """End the app: say so at once, stop the engine (SIGTERM, SIGKILL after `stop_s`), exit. With
        signal handling on (the CLI), a watchdog thread makes sure the process is gone after `deadline_s`
        even if the event loop is stuck; a repeated SIGTERM/SIGINT ends it at once."""
        if self._quitting is not None:
            if force_if_repeated:
                self._hard_exit(return_code)
            return
        self._quitting = why
        if self.handle_signals and deadline_s is not None:
            timer = threading.Timer(deadline_s, self._hard_exit, args=(return_code,))
            timer.daemon = True
            timer.start()
        if self.engine_running:
            self.monitor.engine_state = "stopping"
            self.status_note = "stopping engine…"
            self.changed()
            if isinstance(self.screen, MonitorScreen):
                self.screen.redraw()
        self.workers.cancel_group(self, "load")  # its open streams would hold up the engine's shutdown
        self.run_worker(self._quit(stop_s, return_code), group="quit", exit_on_error=False)

    async def _quit(self, stop_s: float, return_code: int) -> None:
        try:
            await self.stop_process(stop_s)
        finally:
            self.exit(return_code=return_code)

    def _hard_exit(self, return_code: int) -> None:
        if self.process is not None:
            self.process.kill_now()
        driver = self._driver
        hard_exit(return_code, getattr(driver, "attrs_before", None))

    def on_unmount(self) -> None:
        if self.process is not None and self.process.running:
            self.process.kill_now()


def create_app(
    config_dir: Path | str | None = None,
    profile: str | None = None,
    attach_url: str | None = None,
    **options,
) -> StrataApp:
    """Build the app the CLI runs; tests call this with a temp config dir and their own options."""
    store = ProfileStore(Path(config_dir) if config_dir is not None else None)
    return StrataApp(store, profile_name=profile, attach_url=attach_url, **options)
