"""What the server writes to its log (stderr): the engine's warnings and errors, and quieter access lines.

`EventLogger` subscribes to the telemetry bus, like the TUI does, and writes one line per event a person
reading the log must see: every warning and error, every switch that degraded, every graph-cache retry,
wait, fail and degrade, with the real (CUDA) message and the VRAM free at that moment. One subscriber, so
no call site has to remember to log as well as publish. It reads in its own thread: the engine thread
never waits on stderr.

`quiet_monitoring_access()` moves uvicorn's access lines for the monitoring routes (polled every second
by the TUI and by probes) to DEBUG, so the log at INFO shows requests that do something.
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import urlsplit

from engine.telemetry import ErrorEvent, Event, EventBus, GraphEvent, SwitchEvent, VramEvent, WarningEvent

log = logging.getLogger("strata.events")
MONITORING_PATHS = frozenset({"/health", "/metrics", "/strata/state", "/strata/events"})
GRAPH_ACTIONS_LOGGED = {"retry": logging.WARNING, "wait": logging.WARNING, "degrade": logging.WARNING,
                        "fail": logging.ERROR}
_POLL_S = 0.5


class EventLogger:
    """Log the warning- and error-level telemetry events of `bus`, from the first one it still holds."""

    def __init__(self, bus: EventBus, logger: logging.Logger = log) -> None:
        self.logger = logger
        self._sub = bus.subscribe(after_seq=0, max_queue=4096)
        self._free_mib: dict[str, float] = {}  # device -> VRAM free at its last vram event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-event-log", daemon=True)

    def start(self) -> "EventLogger":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Log what is still queued, then stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for event in self._sub.drain():
            self.handle(event)
        self._sub.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for event in self._sub.get(_POLL_S):
                self.handle(event)
            if self._sub.dropped:
                self.logger.warning("event log fell behind: %d telemetry events not logged", self._sub.dropped)
                self._sub.dropped = 0

    def handle(self, event: Event) -> None:
        """Write the line for one event, if it is one a log reader must see."""
        if isinstance(event, VramEvent):
            self._free_mib[event.device] = event.free_mib
            return
        line = self.line(event)
        if line is not None:
            self.logger.log(line[0], "%s", line[1])

    def line(self, event: Event) -> tuple[int, str] | None:
        """(level, text) for `event`, or None for events that are not warnings or errors."""
        if isinstance(event, ErrorEvent):
            free = self._free(event.vram_free_mib)
            kind = "fatal error" if event.fatal else "error"
            return logging.ERROR, f"{kind} in {event.where}: {event.exc_type}: {event.message}{free}"
        if isinstance(event, WarningEvent):
            return logging.WARNING, f"warning in {event.where}: {event.message}"
        if isinstance(event, SwitchEvent) and event.state == "degraded":
            return logging.WARNING, f"switch {event.name} degraded: {event.reason}"
        if isinstance(event, GraphEvent) and event.action in GRAPH_ACTIONS_LOGGED:
            error = f": {event.error}" if event.error else ""
            where = f" on {event.device}" if event.device else ""
            free = self._free(self._free_mib.get(event.device))
            return (GRAPH_ACTIONS_LOGGED[event.action],
                    f"graph {event.action} {event.kind} {event.key} ({event.mib:.0f} MiB{where}){error}{free}")
        return None

    @staticmethod
    def _free(free_mib: float | None) -> str:
        return "" if free_mib is None else f"; VRAM free {free_mib:.0f} MiB"


class _MonitoringAccessToDebug(logging.Filter):
    """uvicorn access records for MONITORING_PATHS become DEBUG records (dropped unless DEBUG is on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        if urlsplit(args[2]).path not in MONITORING_PATHS:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_monitoring_access() -> None:
    """Install the filter on uvicorn's access logger (idempotent)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _MonitoringAccessToDebug) for f in access.filters):
        access.addFilter(_MonitoringAccessToDebug())
