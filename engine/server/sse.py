"""Server-sent events: the wire format, and the /strata/events stream over the telemetry bus.

The events stream sends each telemetry event as `id: <epoch>-<seq>`, `event: <type>`,
`data: <event.to_json()>`; the epoch names the engine process (its bus), because seq restarts at 1 with
each. A late subscriber first gets the bus's recent history (or, with `Last-Event-ID`, only what came after
that id; an id of another epoch, or ahead of the bus, means the engine restarted, so it gets all of the new
history after a comment saying so), then live events. A subscriber that reads too slowly has a bounded queue: the bus drops its oldest events and this
stream reports how many as a `: dropped N` comment (comments are ignored by SSE parsers, so older clients
keep working). An idle stream sends a `: keep-alive` comment every `keepalive_s`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from engine.server.first_of import result_unless
from engine.server.protocol import decimal
from engine.telemetry import EventBus

DONE = "data: [DONE]\n\n"
DEFAULT_KEEPALIVE_S = 15.0
DEFAULT_SUBSCRIBER_QUEUE = 4096  # >= the bus history ring, so a late subscriber gets all of it


def sse_data(payload: Any) -> str:
    """One `data:` message (the OpenAI streaming format). NaN or inf is refused (ValueError, reported in-band
    by the stream): JSON has no such numbers, and a client's parser would fail on the whole chunk."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False, allow_nan=False)}\n\n"


def sse_event(epoch: str, seq: int, event_type: str, payload: dict[str, Any]) -> str:
    return f"id: {epoch}-{seq}\nevent: {event_type}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class EventId:
    """A parsed Last-Event-ID: the bus epoch (None for a bare seq from an older client) and the seq."""

    epoch: str | None
    seq: int


def sse_comment(text: str) -> str:
    return f": {text}\n\n"


def parse_last_event_id(raw: str | None) -> EventId | None:
    """What a reconnecting client has seen: `EPOCH-SEQ` or a bare `SEQ`; None when absent or malformed."""
    if raw is None:
        return None
    epoch, dash, seq = raw.strip().rpartition("-")
    seq_n = decimal(seq)
    if seq_n is None or (dash and decimal(epoch) is None):  # "-1": a dash with no epoch is no id
        return None
    return EventId(epoch or None, seq_n)


async def event_stream(
    bus: EventBus,
    last_event_id: EventId | None,
    stopping: asyncio.Event,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    max_queue: int = DEFAULT_SUBSCRIBER_QUEUE,
) -> AsyncIterator[str]:
    """Telemetry events as SSE until `stopping` is set (then what is queued is flushed) or the client goes
    away (the task is cancelled)."""
    seen = last_event_id
    # An id of another epoch comes from an earlier engine process; a bare seq ahead of this bus does too
    # (an older client that sends no epoch): either way, replay all this engine has.
    restarted = seen is not None and (seen.epoch not in (None, bus.epoch) or seen.seq > bus.last_seq)
    after_seq = 0 if seen is None or restarted else seen.seq
    sub = bus.subscribe(after_seq=after_seq, max_queue=max_queue, loop=asyncio.get_running_loop())
    reported_dropped = 0
    epoch = bus.epoch
    try:
        yield sse_comment(f"strata telemetry; epoch {epoch}; last seq {bus.last_seq}")
        if restarted:
            yield sse_comment(f"Last-Event-ID {seen.epoch or ''}{'-' if seen.epoch else ''}{seen.seq} is from "
                              f"another engine process (this is epoch {epoch}, last seq {bus.last_seq}; the "
                              f"engine restarted): replaying its history")
        history = bus.history(after_seq)
        if not restarted and seen is not None and history and history[0].seq > seen.seq + 1:
            # The ring no longer holds what the client missed: say so instead of pretending it resumed.
            yield sse_comment(f"gap: events {seen.seq + 1}..{history[0].seq - 1} are no longer kept")
        while not stopping.is_set():
            events = await _next_batch(sub, stopping, keepalive_s)
            if sub.dropped > reported_dropped:
                yield sse_comment(f"dropped {sub.dropped - reported_dropped} (total {sub.dropped})")
                reported_dropped = sub.dropped
            if not events:
                if not stopping.is_set():
                    yield sse_comment("keep-alive")
                continue
            yield "".join(sse_event(epoch, e.seq, e.type, e.to_json()) for e in events)
        rest = sub.drain()
        if rest:
            yield "".join(sse_event(epoch, e.seq, e.type, e.to_json()) for e in rest)
    finally:
        sub.close()


async def _next_batch(sub: Any, stopping: asyncio.Event, timeout_s: float) -> list:
    """Events, or [] after `timeout_s` or when the server starts stopping (whichever is first)."""
    got, events = await result_unless(sub.aget(timeout_s), stopping)
    return events if got else sub.drain()
