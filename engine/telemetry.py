"""Telemetry: the typed events of the map, their JSON form, and the bus that carries them. Torch-free leaf.

This module is the one definition of every event: the engine emits them, the server streams them as SSE
(`/strata/events`, id = sequence number), the TUI parses them back with `event_from_json`. Fields carry
their units in their names. `SCHEMA_VERSION` changes when a field changes meaning; adding a field does not
(readers ignore fields they do not know and default the ones they miss).

The bus never blocks the publisher: the engine thread publishes into a bounded history ring and into each
subscriber's bounded queue; a subscriber that falls behind loses its oldest events and counts them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Iterable

SCHEMA_VERSION = 1


@dataclass
class Event:
    """Base of every event. `seq` and `ts` are stamped by the bus when it is published."""

    type: ClassVar[str] = "event"
    seq: int = field(default=0, kw_only=True)
    ts: float = field(default=0.0, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["type"] = self.type
        data["v"] = SCHEMA_VERSION
        return data


@dataclass
class EngineEvent(Event):
    """Engine lifecycle: starting, loading, ready, stopping, exit."""

    type: ClassVar[str] = "engine"
    state: str = "starting"
    detail: str = ""
    exit_code: int | None = None


@dataclass
class SlotEvent(Event):
    """One slot's state. `state`: idle, prefill, decode, finished, aborted, error."""

    type: ClassVar[str] = "slot"
    slot: int = 0
    state: str = "idle"
    request_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    max_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    acceptance: float | None = None  # accepted / proposed MTP drafts for this request so far
    eta_s: float | None = None  # while prefilling: time left at the current prefill rate
    acceptance_per_position: list[float | None] = field(default_factory=list)  # per draft position
    # Where the slot's KV lies (--kv-resident): its resident window, shared-pool blocks, and host memory.
    kv_resident_tokens: int = 0
    kv_pooled_tokens: int = 0
    kv_host_tokens: int = 0


@dataclass
class AdmissionEvent(Event):
    """A request got a slot: fresh (nothing cached) or reused (a cached prefix was found)."""

    type: ClassVar[str] = "admission"
    request_id: str = ""
    slot: int = 0
    reuse: str = "fresh"  # fresh | reused
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queued_s: float = 0.0


@dataclass
class GraphEvent(Event):
    """Graph cache: capture, evict, retry, wait, fail, degrade, release."""

    type: ClassVar[str] = "graph"
    action: str = "capture"
    kind: str = ""  # decode, verify, draft_prefill, draft_round, draft_step, ...
    key: str = ""
    mib: float = 0.0
    ms: float = 0.0
    error: str | None = None
    device: str = ""


@dataclass
class TierEvent(Event):
    """The adaptive VRAM tier (GPU prefix cache) grew or shrank."""

    type: ClassVar[str] = "tier"
    action: str = "grow"  # grow | shrink
    mib: float = 0.0  # how much it changed by
    total_mib: float = 0.0  # its size afterwards
    reason: str = ""
    device: str = ""


@dataclass
class ExpertEvent(Event):
    """The MoE expert cache: its pools grew or shrank (a budget change, a VRAM-books request), or, summed
    over about a second, experts were loaded into slots (misses) and evicted to make room."""

    type: ClassVar[str] = "expert"
    action: str = "load"  # load | evict | shrink | grow
    experts: int = 0  # load / evict: how many
    mib: float = 0.0  # load: bytes copied in; shrink / grow: the change
    total_mib: float = 0.0  # the pools' device memory afterwards
    slots: int = 0  # slots per layer afterwards
    ms: float = 0.0  # load: copy time; shrink / grow: the resize
    reason: str = ""
    device: str = ""


@dataclass
class KvEvent(Event):
    """`--kv-resident` paging, one per step part that moved blocks: `spill` (pool blocks to host memory, to make
    room), `fetch` (host blocks back to the device for a forward that reads them), `grow` (the shared pool took
    memory the prefix-cache tier gave back)."""

    type: ClassVar[str] = "kv"
    action: str = "spill"  # spill | fetch | grow
    blocks: int = 0
    tokens: int = 0  # blocks x tokens per block
    mib: float = 0.0  # bytes copied (spill / fetch) or added to the pool (grow)
    ms: float = 0.0  # the copies (or the pool's reallocation), device synced; a CUDA fetch: its copy stream's time
    host_mib: float = 0.0  # KV held in host memory afterwards
    slots: list[int] = field(default_factory=list)  # the slots whose blocks moved
    reason: str = ""
    device: str = ""


@dataclass
class VramEvent(Event):
    """The engine's VRAM breakdown for one device."""

    type: ClassVar[str] = "vram"
    device: str = ""
    total_mib: float = 0.0
    weights_mib: float = 0.0
    kv_mib: float = 0.0
    graphs_mib: float = 0.0
    tier_mib: float = 0.0
    reserve_mib: float = 0.0
    free_mib: float = 0.0
    experts_mib: float = 0.0  # the MoE expert cache's pools (0 for a dense model)
    host_kv_mib: float = 0.0  # --kv-resident: KV spilled to host memory (not VRAM; shown beside the books)
    weight_format: str = ""  # the weights' storage: bf16, fp8 (block 128x128), int4 (awq, group 128), gguf ...


@dataclass
class SwitchEvent(Event):
    """An opt-in switch changed: on, off, degraded (its code path failed), or unavailable (a toggle of a switch
    whose code path cannot run on this engine: it stays off, `reason` says why)."""

    type: ClassVar[str] = "switch"
    name: str = ""
    state: str = "on"
    reason: str = ""


@dataclass
class WarningEvent(Event):
    type: ClassVar[str] = "warning"
    where: str = ""
    message: str = ""


@dataclass
class ErrorEvent(Event):
    """An error with the real message (walked through __cause__/__context__) and VRAM free at that moment."""

    type: ClassVar[str] = "error"
    where: str = ""
    exc_type: str = ""
    message: str = ""
    vram_free_mib: float | None = None
    fatal: bool = False


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (EngineEvent, SlotEvent, AdmissionEvent, GraphEvent, TierEvent, ExpertEvent, KvEvent, VramEvent,
                SwitchEvent, WarningEvent, ErrorEvent)
}


def event_from_json(data: dict[str, Any]) -> Event:
    """Parse one event's JSON form; unknown fields are ignored, an unknown type raises ValueError."""
    kind = data.get("type")
    cls = EVENT_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown telemetry event type {kind!r}")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


class Subscription:
    """One subscriber's bounded queue. Drops its oldest events when full and counts them in `dropped`."""

    def __init__(self, bus: "EventBus", max_queue: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self._bus = bus
        self._queue: deque[Event] = deque(maxlen=max_queue)
        self._cond = threading.Condition()
        self._loop = loop
        self._async_ready = asyncio.Event() if loop is not None else None
        self.dropped = 0
        self.closed = False

    def _push(self, event: Event) -> None:
        with self._cond:
            was_empty = not self._queue
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(event)
            self._cond.notify_all()
        # One wake-up of the subscribing loop per burst, not per event (a step publishes many): every drain
        # empties the queue, so the first event after it wakes the loop and the loop's next drain takes the rest.
        if was_empty and self._loop is not None and self._async_ready is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_ready.set)
            except RuntimeError:  # the loop closed under us: the subscriber is gone
                self.close()

    def drain(self) -> list[Event]:
        """Everything queued now, oldest first."""
        with self._cond:
            items = list(self._queue)
            self._queue.clear()
            return items

    def get(self, timeout_s: float | None = None) -> list[Event]:
        """Block (in a thread) until at least one event is queued or the timeout passes."""
        with self._cond:
            if not self._queue and not self.closed:
                self._cond.wait(timeout_s)
            items = list(self._queue)
            self._queue.clear()
            return items

    async def aget(self, timeout_s: float | None = None) -> list[Event]:
        """Await (on the subscribing loop) at least one event or the timeout."""
        assert self._async_ready is not None, "subscribe(loop=...) to await events"
        items = self.drain()
        if items or self.closed:
            return items
        self._async_ready.clear()
        items = self.drain()  # an event may have landed between drain and clear
        if items:
            return items
        try:
            await asyncio.wait_for(self._async_ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            return []
        return self.drain()

    def close(self) -> None:
        self.closed = True
        self._bus._unsubscribe(self)
        with self._cond:
            self._cond.notify_all()


class EventBus:
    """Thread-safe publish/subscribe with a history ring for late subscribers."""

    def __init__(self, history: int = 2048) -> None:
        # Which bus (engine process) a seq belongs to: seq restarts at 1 with every process, so a resuming
        # reader needs both (SSE ids are "EPOCH-SEQ"). Start time in microseconds: readable, and distinct
        # for two buses of one process.
        self.epoch = str(time.time_ns() // 1000)
        self._lock = threading.Lock()
        self._history: deque[Event] = deque(maxlen=history)
        self._subs: list[Subscription] = []
        self._seq = 0

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, event: Event) -> Event:
        """Stamp `seq`/`ts` and deliver. Never blocks on a subscriber."""
        with self._lock:
            self._seq += 1
            event.seq = self._seq
            event.ts = time.time()
            self._history.append(event)
            subs = list(self._subs)
        for sub in subs:
            sub._push(event)
        return event

    def history(self, after_seq: int = 0) -> list[Event]:
        with self._lock:
            return [e for e in self._history if e.seq > after_seq]

    def subscribe(
        self,
        after_seq: int | None = 0,
        max_queue: int = 4096,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Subscription:
        """Subscribe; the queue starts with history after `after_seq` (None: no history, live only)."""
        sub = Subscription(self, max_queue, loop)
        with self._lock:
            if after_seq is not None:
                for e in self._history:
                    if e.seq > after_seq:
                        sub._queue.append(e)
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def latest(self, types: Iterable[str] | None = None) -> list[Event]:
        wanted = set(types) if types else None
        with self._lock:
            return [e for e in self._history if wanted is None or e.type in wanted]
