"""Everything the screens draw, in one object. Pure Python, no Textual.

The reducer (`strata_tui/state/reducer.py`) folds the workers' news into it and Controls its keys; each of the
monitor's widgets is handed it and reads its own slice on its own refresh tick (strata_tui/widgets/view_bound.py).
`version` moves on every change, so a tick with nothing new does nothing. The engine as seen through telemetry
is `monitor` (MonitorState); the rest is what the app itself knows: the profile, the process and connection, GPU
readings, the log, the crash, notes to show.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from engine.telemetry import Event
from strata_tui.adapters.crash_lines import pick_engine_error
from strata_tui.adapters.view import ForeignView
from strata_tui.engine_io.gpu import GpuHistory
from strata_tui.profiles.profile import Profile, ProfileError, TuiSettings
from strata_tui.state.history import History
from strata_tui.state.monitor_state import MonitorState

LOG_LINES = 2000
STDERR_TAIL = 40
# A log record's level, as Python logging and uvicorn write it ("ERROR:", "WARNING ", "INFO:  ").
_LEVEL = re.compile(r"\b(DEBUG|INFO|NOTICE|WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_SERIOUS_LEVELS = {"WARNING", "WARN", "ERROR", "CRITICAL", "FATAL"}
# A line with no level that still states an error: a traceback's last line, a CUDA error, "error: ...".
# An access-log line for one of this app's own polls (uvicorn's format: `"GET /health HTTP/1.1" 200`).
# Another engine's routes this app reads every second (vLLM and SGLang log them through uvicorn too).
_OWN_POLLING = re.compile(r'"GET /(health|strata/state|strata/events|metrics|version|get_server_info|props|slots)'
                          r'[^"]*" \d{3}')
_ERROR_TEXT = re.compile(r"(\berror\b[:\s]|^\w*(Error|Exception)\b|\bCUDA error\b)", re.IGNORECASE)


def pick_error_line(lines: Iterable[str]) -> str | None:
    """The engine's last stderr line that is a WARNING/ERROR record or states an error; never an INFO
    (or DEBUG) record, whatever its logger is called (uvicorn's INFO lines come from "uvicorn.error")."""
    for line in reversed([line.strip() for line in lines if line.strip()]):
        level = _LEVEL.search(line)
        if level is not None:
            if level.group(1) in _SERIOUS_LEVELS:
                return line
            continue
        if _ERROR_TEXT.search(line):
            return line
    return None


def severity_of(line: str) -> str:
    """"warning" for a WARNING record, else "error": what the crash panel calls the line it shows."""
    level = _LEVEL.search(line)
    return "warning" if level is not None and level.group(1) in ("WARNING", "WARN") else "error"


@dataclass
class CrashInfo:
    """What the crash panel shows about the engine's end."""

    returncode: int | None
    error: str | None
    recent: list[Event]
    requested: bool
    why_stopped: str = ""  # the user's own action when they stopped it ("you pressed s")


@dataclass
class ViewState:
    """The app's view of the world. `mode`: launched | attached | offline."""

    mode: str
    attach_url: str | None = None
    monitor: MonitorState = field(default_factory=lambda: MonitorState.for_profile({}, 0))
    profile: Profile | None = None
    profile_error: ProfileError | None = None
    gpu_history: GpuHistory = field(default_factory=GpuHistory)
    gpu_unavailable: str | None = None
    history: History = field(default_factory=History)  # one sample a second of what the engine did
    log_lines: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    log_total: int = 0
    own_polling_lines: int = 0  # access-log lines of this app's own polling, kept out of the log view
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL))
    run: int = 0  # the engine run (or attachment) news is taken from; older runs' news is dropped
    engine_url: str | None = None
    telemetry_connected: bool | None = None
    telemetry_reason: str = ""  # why the event stream dropped; shown while it reconnects
    unreachable_since: float | None = None  # wall clock of the first failure since the last success
    unreachable_reason: str = ""  # why the last probe failed; shown only while unreachable
    # The engine instance the monitor's state was read from (/strata/state's `instance_id`, else its start
    # time; None: not read yet, or an engine that names none). A snapshot of another instance replaces
    # everything the old one said.
    engine_instance: str | None = None
    # The connection dropped or the engine stopped answering since the state was last read: what is shown may
    # be another engine's (one restarted on the same port), so it is drawn stale and a switch key in attach
    # mode waits for the state to be read again.
    resyncing: bool = False
    stopping_why: str = ""  # the user's own stop ("you pressed s", "quit"): news of its going is no error
    status_note: str = ""
    reserve_note: str = ""
    expert_note: str = ""  # the last answer about the expert-cache budget keys
    load_running: str | None = None  # the scenario being played
    load_progress: str = ""  # its latest step
    load_result: str | None = None  # the last scenario's result, for its panel
    crash: CrashInfo | None = None
    kind: str = "strata"  # the engine watched: strata | vllm | sglang | llamacpp (strata_tui/profiles/kinds.py)
    foreign: ForeignView | None = None  # a non-Strata engine's endpoints, as its adapter reads them
    _changes: int = 0

    @property
    def version(self) -> int:
        return self.monitor.version + self._changes

    def changed(self) -> None:
        self._changes += 1

    @property
    def attached(self) -> bool:
        return self.mode == "attached"

    @property
    def profile_name(self) -> str:
        if self.profile is not None:
            return self.profile.name
        return self.profile_error.path.stem if self.profile_error else "(none)"

    @property
    def settings(self) -> TuiSettings:
        return self.profile.tui if self.profile is not None else TuiSettings()

    @property
    def stale(self) -> bool:
        """What telemetry said may no longer be true: the engine is not answering, or has exited."""
        return self.unreachable_since is not None or self.resyncing or self.monitor.engine_state == "exited"

    def append_log(self, lines: Iterable[tuple[str, str]]) -> None:
        for stream, line in lines:
            if _OWN_POLLING.search(line):
                self.own_polling_lines += 1  # the engine logging our own /health and /strata polls
                continue
            self.log_lines.append((stream, line))
            self.log_total += 1
            if stream == "stderr" and line.strip():
                self.stderr_tail.append(line)
        self.changed()

    def last_error_text(self) -> str | None:
        """The real error: the engine's last ErrorEvent, else its last WARNING/ERROR stderr line (for another
        engine kind, the root cause its own log names)."""
        if self.kind != "strata":
            return pick_engine_error(self.kind, (line for _, line in self.log_lines)) or pick_error_line(self.stderr_tail)
        event = self.monitor.last_error
        if event is not None:
            where = f"{event.where}: " if event.where else ""
            kind = f"{event.exc_type}: " if event.exc_type else ""
            free = f" (VRAM free {event.vram_free_mib:.0f} MiB)" if event.vram_free_mib is not None else ""
            return f"{where}{kind}{event.message}{free}"
        return pick_error_line(self.stderr_tail)
