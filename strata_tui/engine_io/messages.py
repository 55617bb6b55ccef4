"""Messages the workers post up to the app. Dataclasses, one file (as Toolong does).

Every one is `EngineNews`: the app has one handler for them all (`StrataApp.on_engine_news`), which hands
each to the reducer (`strata_tui/state/reducer.py`). `run` names the engine run (or attachment) a message belongs
to; news of a run that is over is dropped there.

High-rate messages that carry a whole picture (GPU readings, connection status) define `can_replace`, so
a burst queued behind a slow frame collapses to the newest. Telemetry batches and log lines carry
distinct content and are never collapsed; they are folded into state and drawn on the next refresh tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual.message import Message

from engine.snapshot import ExpertCacheSnapshot, KvPagingSnapshot
from engine.telemetry import Event
from strata_tui.engine_io.gpu import GpuSample


class EngineNews(Message):
    """What a worker reports. All kinds dispatch to one handler, `on_engine_news`."""

    run: ClassVar[int | None] = None  # set per instance by the app's run-bound `post` (None: any run)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.handler_name = "on_engine_news"


@dataclass
class TelemetryBatch(EngineNews):
    """Events from the SSE stream: the reads of up to `batch_s` (telemetry_client.stream_telemetry), in order."""

    events: list[Event]


@dataclass
class StateSnapshot(EngineNews):
    """The `/strata/state` snapshot, fetched on every (re)connect; `fresh_engine` when the engine answering
    is not the one seen before (its event numbers started again)."""

    snapshot: dict
    fresh_engine: bool = False


@dataclass
class ExpertsSnapshot(EngineNews):
    """The `experts` section of `/strata/state`, polled about once a second for an MoE engine (its hit
    counters are in no event); each one carries the whole picture, so a burst collapses to the newest."""

    experts: ExpertCacheSnapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ExpertsSnapshot)


@dataclass
class KvPoolSnapshot(EngineNews):
    """The `kv.paging` and `queue` sections of `/strata/state` (KV by use: blocks used, free, the tier's, on the host;
    the requests waiting), read with the experts' poll; each one carries the whole picture, so a burst collapses
    to the newest."""

    paging: KvPagingSnapshot | None
    admission_wait: str = ""  # `queue.admission_wait`: why the head of the queue waits while a slot is free
    waiting: int | None = None  # `queue.waiting`: requests waiting for a slot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, KvPoolSnapshot)


@dataclass
class TelemetryStatus(EngineNews):
    """The event stream connected or dropped (with why)."""

    connected: bool
    reason: str

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, TelemetryStatus)


@dataclass
class EngineLiveness(EngineNews):
    """The engine started or stopped answering /health (with why). `seen_s`: the wall clock when the probe saw it
    (the status's "unreachable since" is then the probe's moment, not when a busy app got to the message)."""

    answering: bool
    reason: str
    seen_s: float | None = None

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, EngineLiveness)


@dataclass
class GpuSampled(EngineNews):
    """One NVML reading of every GPU (or why there is none)."""

    samples: list[GpuSample]
    unavailable: str | None = None

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, GpuSampled)


@dataclass
class EngineOutput(EngineNews):
    """Lines the engine wrote: (stream, line) pairs."""

    lines: list[tuple[str, str]]
    run: int = 0


@dataclass
class EngineReady(EngineNews):
    """The engine printed its ready line."""

    url: str
    run: int = 0  # which launch this belongs to (a restart must not take an old run's news)


@dataclass
class EngineExited(EngineNews):
    """The engine process ended (or could not start)."""

    returncode: int
    requested: bool
    error: str | None = None
    run: int = 0


@dataclass
class LoadProgress(EngineNews):
    """A load scenario said something (progress or its result)."""

    text: str
    done: bool = False
    failed: bool = False
