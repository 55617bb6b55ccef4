"""The workers' news folded into the view state: one reducer. Pure Python (no widgets, no I/O).

`reduce(view, message, now_s, wall_s)` changes the ViewState for one message and returns what the app must
do because of it (effects: open the run's client, re-read an engine's state, redraw now, a toast). The app
only wires: it runs the workers, hands every message here, and carries the effects out. So where the
status line's truth and an attachment's resync live is this file, testable without a terminal.

Rules kept here:
- News of a run that is over (a restart, or an earlier attachment's client) is dropped.
- Nothing an engine said survives a snapshot from another instance; a connection that dropped, or an engine
  that stopped answering, leaves the state `resyncing` (drawn stale) until `/strata/state` is read again.
- A stop the user asked for is no error: the probes failing while it goes are not news.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine.snapshot import EngineSnapshot
from engine.telemetry import EngineEvent, ErrorEvent
from strata_tui.engine_io.foreign import EndpointRead
from strata_tui.engine_io.messages import (
    EngineExited,
    EngineLiveness,
    EngineNews,
    EngineOutput,
    EngineReady,
    ExpertsSnapshot,
    KvPoolSnapshot,
    GpuSampled,
    LoadProgress,
    StateSnapshot,
    TelemetryBatch,
    TelemetryStatus,
)
from strata_tui.state.view_state import CrashInfo, ViewState

TELEMETRY_DRAIN_S = 1.0
RESULT_HINT = "result in the panel below (escape closes it)"  # an exited engine's stream may still hold its last events (the fatal error)
REASON_CHARS = 120  # a reason on the one-line status bar: the route and the limit fit


@dataclass(frozen=True)
class OpenClient:
    """Open the run's one HTTP client on `url` and start its workers (stream, liveness, expert poll)."""

    url: str


@dataclass(frozen=True)
class CloseClientLater:
    """Close run `run`'s client after `after_s`, if that run is still the current one and has ended."""

    run: int
    after_s: float


@dataclass(frozen=True)
class Resync:
    """The engine answers again: read its state now and reconnect the event stream without waiting."""


@dataclass(frozen=True)
class RedrawNow:
    """Draw now, not on the next tick (news of the engine's liveness)."""


@dataclass(frozen=True)
class Notify:
    text: str
    title: str = ""
    severity: str = "information"
    timeout_s: float = 10.0


Effect = OpenClient | CloseClientLater | Resync | RedrawNow | Notify


def reduce(view: ViewState, message: EngineNews, now_s: float, wall_s: float) -> list[Effect]:
    """Fold `message` into `view`. `now_s`: the local monotonic clock (ETAs count down on it); `wall_s`:
    wall time (the status line's "unreachable since")."""
    if message.run is not None and message.run != view.run:
        return []
    handler = _HANDLERS.get(type(message))
    return handler(view, message, now_s, wall_s) if handler is not None else []


def instance_of(snapshot: Any) -> str | None:
    """Which engine process a `/strata/state` answer comes from, where it says."""
    if not isinstance(snapshot, dict):
        return None
    instance = snapshot.get("instance_id", snapshot.get("started_at"))
    return str(instance) if instance is not None else None


def _ended(view: ViewState) -> bool:
    """The engine this app launched has exited or is being stopped: its probes failing is not news."""
    if view.attached:
        return False
    return view.crash is not None or view.monitor.engine_state in ("stopping", "exited") or bool(view.stopping_why)


def _output(view: ViewState, message: EngineOutput, now_s: float, wall_s: float) -> list[Effect]:
    view.append_log(message.lines)
    return []


def _ready(view: ViewState, message: EngineReady, now_s: float, wall_s: float) -> list[Effect]:
    view.engine_url = message.url
    if view.monitor.engine_state in ("starting", "loading", "not started"):
        view.monitor.engine_state = "ready"
    view.changed()
    return [OpenClient(message.url)]


def _exited(view: ViewState, message: EngineExited, now_s: float, wall_s: float) -> list[Effect]:
    view.telemetry_connected, view.unreachable_since, view.unreachable_reason = None, None, ""
    view.resyncing = False
    view.monitor.note_exit(message.returncode)
    view.monitor.slots.clear()
    view.crash = CrashInfo(message.returncode, message.error or view.last_error_text(),
                           list(view.monitor.recent), message.requested, view.stopping_why)
    if view.status_note == "stopping engine…":
        view.status_note = ""
    if message.error:
        view.append_log([("tui", message.error)])
    view.changed()
    return [CloseClientLater(view.run, TELEMETRY_DRAIN_S)]


def _telemetry(view: ViewState, message: TelemetryBatch, now_s: float, wall_s: float) -> list[Effect]:
    view.monitor.apply_all(message.events, now_s)
    if view.crash is not None and not view.attached:
        # Late events of a run that already exited: they may carry the real error.
        view.crash.error = view.last_error_text() or view.crash.error
        view.crash.recent = list(view.monitor.recent)
    if view.attached:
        for event in message.events:
            if isinstance(event, EngineEvent) and event.state == "exit":
                view.crash = CrashInfo(event.exit_code, view.last_error_text(), list(view.monitor.recent), False)
            elif isinstance(event, EngineEvent) and event.state in ("starting", "ready"):
                view.crash = None
            elif isinstance(event, ErrorEvent) and event.fatal:
                view.crash = CrashInfo(None, view.last_error_text(), list(view.monitor.recent), False)
    return []


def _snapshot(view: ViewState, message: StateSnapshot, now_s: float, wall_s: float) -> list[Effect]:
    monitor = view.monitor
    instance = instance_of(message.snapshot)
    # Another engine, or one that cannot say which it is after the connection was lost: start from nothing.
    other = (instance != view.engine_instance if instance is not None
             else message.fresh_engine or view.resyncing)
    reserve_before = monitor.vram_reserve_mib
    if other:
        monitor.forget_engine()
        view.reserve_note, view.expert_note = "", ""
    monitor.apply_snapshot(EngineSnapshot.from_json(message.snapshot))
    if monitor.vram_reserve_mib != reserve_before:
        view.reserve_note = ""  # "applied live" was about a value this engine does not have
    view.engine_instance = instance
    view.resyncing = False
    view.unreachable_since, view.unreachable_reason = None, ""
    if view.attached and monitor.engine_state in ("attaching", "exited"):
        monitor.engine_state = "ready"
        view.crash = None
    view.changed()
    return []


def _experts(view: ViewState, message: ExpertsSnapshot, now_s: float, wall_s: float) -> list[Effect]:
    view.monitor.apply_experts(message.experts)
    view.changed()
    return []


def _kv_pool(view: ViewState, message: KvPoolSnapshot, now_s: float, wall_s: float) -> list[Effect]:
    view.monitor.apply_kv_pool(message.paging, message.admission_wait, message.waiting)  # bumps the monitor's version only when the pool's use changed
    return []


def _stream_status(view: ViewState, message: TelemetryStatus, now_s: float, wall_s: float) -> list[Effect]:
    if _ended(view):
        return []  # the engine is going or gone: its stream ending is not news
    if not message.connected and view.telemetry_connected:
        view.resyncing = True  # whoever answers next may be another engine
    view.telemetry_connected = message.connected
    view.telemetry_reason = "" if message.connected else message.reason[:REASON_CHARS]
    view.changed()
    return []


def _liveness(view: ViewState, message: EngineLiveness, now_s: float, wall_s: float) -> list[Effect]:
    if _ended(view):
        return []
    if message.answering:
        if view.unreachable_since is None:
            return []
        view.unreachable_since, view.unreachable_reason = None, ""
        view.changed()
        # It answers again, and may be another engine on the same port: read its state now.
        return [Resync(), RedrawNow()]
    if view.unreachable_since is not None:
        return []
    view.unreachable_since = wall_s if message.seen_s is None else message.seen_s
    view.unreachable_reason = message.reason[:80]
    view.resyncing = True
    view.changed()
    return [RedrawNow()]


def _endpoint(view: ViewState, message: EndpointRead, now_s: float, wall_s: float) -> list[Effect]:
    """One endpoint's reading (another engine kind's, or a row beside a Strata engine): its row; the first
    endpoint of another kind also says whether the engine answers (a Strata engine's liveness has its probe)."""
    foreign = view.foreign
    if (foreign is None or message.index >= len(foreign.endpoints)
            or message.view.kind != foreign.endpoints[message.index].kind):
        return []
    foreign.endpoints[message.index] = message.view
    if message.index == 0 and view.kind != "strata":
        if message.view.reachable:
            view.unreachable_since = None
            if view.monitor.engine_state in ("attaching", "starting", "not started"):
                view.monitor.engine_state = "ready"
        elif view.unreachable_since is None and not (view.crash is not None and not view.attached):
            view.unreachable_since = message.view.unreachable_since
    view.changed()
    return []


def _gpu(view: ViewState, message: GpuSampled, now_s: float, wall_s: float) -> list[Effect]:
    view.gpu_history.add(message.samples)
    if message.samples or view.gpu_unavailable != message.unavailable:
        view.gpu_unavailable = message.unavailable
        view.changed()
    return []


def _load(view: ViewState, message: LoadProgress, now_s: float, wall_s: float) -> list[Effect]:
    effects: list[Effect] = []
    if message.done:
        view.load_running, view.load_result, view.load_progress = None, message.text, ""
        view.status_note = f"load {'failed' if message.failed else 'done'}: {RESULT_HINT}"
        # the pop-up words the hint as the status line does
        effects.append(Notify(f"{message.text.splitlines()[0]}\n{RESULT_HINT}", "load",
                              "error" if message.failed else "information"))
    else:
        view.load_progress = message.text[:120]
    view.changed()
    return effects


_HANDLERS: dict[type, Callable[[ViewState, Any, float, float], list[Effect]]] = {
    EngineOutput: _output,
    EngineReady: _ready,
    EngineExited: _exited,
    TelemetryBatch: _telemetry,
    StateSnapshot: _snapshot,
    ExpertsSnapshot: _experts,
    KvPoolSnapshot: _kv_pool,
    TelemetryStatus: _stream_status,
    EngineLiveness: _liveness,
    GpuSampled: _gpu,
    LoadProgress: _load,
    EndpointRead: _endpoint,
}
