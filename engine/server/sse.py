"""Server-sent events: the wire format, and the /strata/events stream over the telemetry bus.

The events stream sends each telemetry event as `id: <seq>`, `event: <type>`, `data: <event.to_json()>`.
A late subscriber first gets the bus's recent history (or, with `Last-Event-ID`, only what came after that
id; an id ahead of the bus means the engine restarted, so it gets all of the new history), then live
events. A subscriber that reads too slowly has a bounded queue: the bus drops its oldest events and this
stream reports how many as a `: dropped N` comment (comments are ignored by SSE parsers, so older clients
keep working). An idle stream sends a `: keep-alive` comment every `keepalive_s`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from engine.telemetry import EventBus

DONE = "data: [DONE]\n\n"
DEFAULT_KEEPALIVE_S = 15.0
DEFAULT_SUBSCRIBER_QUEUE = 4096  # >= the bus history ring, so a late subscriber gets all of it


def sse_data(payload: Any) -> str:
    """One `data:` message (the OpenAI streaming format)."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_event(seq: int, event_type: str, payload: dict[str, Any]) -> str:
    return f"id: {seq}\nevent: {event_type}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_comment(text: str) -> str:
    return f": {text}\n\n"


def parse_last_event_id(raw: str | None) -> int | None:
    """The sequence number a reconnecting client has seen, or None (absent or not a number: send history)."""
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        return None
    return value if value >= 0 else None


async def event_stream(
    bus: EventBus,
    last_event_id: int | None,
    stopping: asyncio.Event,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    max_queue: int = DEFAULT_SUBSCRIBER_QUEUE,
) -> AsyncIterator[str]:
    """Telemetry events as SSE until `stopping` is set (then what is queued is flushed) or the client goes
    away (the task is cancelled)."""
    restarted = last_event_id is not None and last_event_id > bus.last_seq
    # An id ahead of this bus comes from an earlier engine process (seq restarts at 1): replay all we have.
    after_seq = 0 if last_event_id is None or restarted else last_event_id
    sub = bus.subscribe(after_seq=after_seq, max_queue=max_queue, loop=asyncio.get_running_loop())
    reported_dropped = 0
    try:
        yield sse_comment(f"strata telemetry; last seq {bus.last_seq}")
        if restarted:
            yield sse_comment(f"Last-Event-ID {last_event_id} is ahead of this engine's last seq {bus.last_seq} "
                              f"(the engine restarted): replaying its history")
        history = bus.history(after_seq)
        if not restarted and last_event_id is not None and history and history[0].seq > last_event_id + 1:
            # The ring no longer holds what the client missed: say so instead of pretending it resumed.
            yield sse_comment(f"gap: events {last_event_id + 1}..{history[0].seq - 1} are no longer kept")
        while not stopping.is_set():
            events = await _next_batch(sub, stopping, keepalive_s)
            if sub.dropped > reported_dropped:
                yield sse_comment(f"dropped {sub.dropped - reported_dropped} (total {sub.dropped})")
                reported_dropped = sub.dropped
            if not events:
                if not stopping.is_set():
                    yield sse_comment("keep-alive")
                continue
            yield "".join(sse_event(e.seq, e.type, e.to_json()) for e in events)
        rest = sub.drain()
        if rest:
            yield "".join(sse_event(e.seq, e.type, e.to_json()) for e in rest)
    finally:
        sub.close()


async def _next_batch(sub: Any, stopping: asyncio.Event, timeout_s: float) -> list:
    """Events, or [] after `timeout_s` or when the server starts stopping (whichever is first)."""
    getter = asyncio.ensure_future(sub.aget(timeout_s))
    stopper = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return sub.drain()
