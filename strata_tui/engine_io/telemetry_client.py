"""The app's HTTP client for one engine: state snapshot, the SSE event stream, and the control routes.

`events()` streams `/strata/events` with httpx, parses SSE incrementally, and reconnects after a dropped
connection with `Last-Event-ID` set to the last sequence number it saw, so the engine's history ring fills
the gap. It yields batches (every event completed by one network read), which keeps message traffic into
the UI proportional to reads, not to events. `stream_telemetry` is the worker body that follows it and posts
the batches to the app: the stream is read, parsed and posted in this one file.

The engine is read as untrusted, as the other engines' adapters read theirs (strata_tui/adapters/base.py): every
body is read to a limit and no further (TooLarge), `/strata/state` within a deadline for the whole read (a server
that trickles never trips a read timeout), and an event of the stream past the parser's limit (EventTooLarge)
drops the connection, which is tried again after the usual back-off. Each says why in the status line.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from engine.telemetry import Event, event_from_json
from strata_tui.adapters.base import MAX_BODY_BYTES, TooLarge, fetch, read_body
from strata_tui.engine_io.http_errors import describe_http_error
from strata_tui.engine_io.messages import StateSnapshot, TelemetryBatch, TelemetryStatus
from strata_tui.engine_io.sse import MAX_EVENT_CHARS, EventTooLarge, SSEParser

Post = Callable[[Any], Any]  # the app's post_message (bound to the run): how a worker reports
STATE_DEADLINE_S = 10.0  # one whole /strata/state read; a big engine's answers in milliseconds
MAX_ANSWER_BYTES = 64 << 10  # /health and the control routes answer a few hundred bytes


@dataclass(frozen=True)
class ControlResult:
    """What a control route answered: applied or not, and the engine's own words when not."""

    ok: bool
    status: int
    message: str
    body: dict[str, Any] | None = None


class TelemetryClient:
    """HTTP + SSE client for `strata-engine serve` at `base_url`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        reconnect_s: float = 0.5,
        max_reconnect_s: float = 5.0,
        max_state_bytes: int = MAX_BODY_BYTES,
        max_event_chars: int = MAX_EVENT_CHARS,
        state_deadline_s: float = STATE_DEADLINE_S,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        # No read timeout: the event stream is idle whenever the engine is.
        timeout = httpx.Timeout(10.0, read=None)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self.reconnect_s = reconnect_s
        self.max_reconnect_s = max_reconnect_s
        self.max_state_bytes = max_state_bytes
        self.max_event_chars = max_event_chars
        self.state_deadline_s = state_deadline_s
        self.last_data_s: float | None = None  # monotonic time of the event stream's last bytes: the engine answers
        self.last_seq = 0
        self.last_event_id: str | None = None  # "EPOCH-SEQ": the engine resumes us, or replays after a restart
        self.epoch: str | None = None
        self.skipped_events = 0  # events of a type this build does not know (a newer engine)
        self.engine_restarts = 0  # times the event numbers started again: another engine answers now
        self._wake = asyncio.Event()  # set to cut a reconnect's back-off short

    def reconnect_now(self) -> None:
        """The engine answers again (the liveness probe says so): retry a dropped stream now, not after the
        back-off, which after a few refused attempts is several seconds."""
        self._wake.set()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def state(self) -> dict[str, Any]:
        """GET /strata/state, read whole within `state_deadline_s` and to `max_state_bytes` at most. Raises
        TooLarge, TimeoutError (saying how long it waited) or ValueError (not 200, not JSON) with the reason."""
        try:
            async with asyncio.timeout(self.state_deadline_s):  # a trickle never trips httpx's read timeout
                status, body = await fetch(self._http, "/strata/state", self.max_state_bytes)
        except TimeoutError:
            raise TimeoutError(f"no whole answer from /strata/state in {self.state_deadline_s:.0f} s") from None
        if status != 200:
            raise ValueError(f"/strata/state answered {status}: {_message_of(_json_or_none(body), _text(body))}")
        return json.loads(body)

    async def health(self, timeout_s: float | None = None) -> tuple[bool, str]:
        """GET /health: (ready, reason). Raises httpx errors when the engine does not answer in time."""
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        try:
            status, body = await fetch(self._http, "/health", MAX_ANSWER_BYTES, timeout=timeout)
        except TooLarge as exc:
            return False, str(exc)
        answer = _json_or_none(body)
        reason = answer.get("reason", _text(body)) if isinstance(answer, dict) else _text(body)
        return status == 200, str(reason)

    async def set_switch(self, name: str, enabled: bool) -> ControlResult:
        """POST /strata/switches/{NAME}; a 409 means the switch is read at start only."""
        return await self._post(f"/strata/switches/{name}", {"enabled": enabled})

    async def set_vram_reserve(self, mib: int) -> ControlResult:
        return await self._post("/strata/vram-reserve", {"mib": mib})

    async def set_expert_cache_mib(self, mib: int) -> ControlResult:
        """POST /strata/expert-cache; the answer's body carries the cache's snapshot (`experts`); 409: dense."""
        return await self._post("/strata/expert-cache", {"mib": mib})

    async def _post(self, path: str, payload: dict[str, Any]) -> ControlResult:
        try:
            async with asyncio.timeout(self.state_deadline_s):
                async with self._http.stream("POST", path, json=payload) as response:
                    raw = await read_body(response, path, MAX_ANSWER_BYTES)
        except TooLarge as exc:
            return ControlResult(False, 0, str(exc))
        except TimeoutError:
            return ControlResult(False, 0, f"no whole answer from {path} in {self.state_deadline_s:.0f} s")
        except httpx.HTTPError as exc:
            return ControlResult(False, 0, f"{type(exc).__name__}: {exc}")
        body = _json_or_none(raw)
        return ControlResult(response.is_success, response.status_code, _message_of(body, _text(raw)),
                             body if isinstance(body, dict) else None)

    async def events(
        self,
        on_status: Callable[[bool, str], None] | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncIterator[list[Event]]:
        """Yield batches of events forever, reconnecting with Last-Event-ID; cancel the iterator to stop.
        `on_connect` is awaited on every connection before its events are read (to re-read state)."""
        delay_s = self.reconnect_s
        while True:
            headers = {"Accept": "text/event-stream"}
            if self.last_event_id is not None:
                headers["Last-Event-ID"] = self.last_event_id
            backoff_s = delay_s
            try:
                async with self._http.stream("GET", "/strata/events", headers=headers) as response:
                    if response.status_code != 200:
                        raw = await read_body(response, "/strata/events", MAX_ANSWER_BYTES)
                        raise httpx.HTTPStatusError(
                            f"{response.status_code} {_message_of(_json_or_none(raw), _text(raw))}",
                            request=response.request, response=response)
                    if on_connect:
                        await on_connect()
                    if on_status:
                        on_status(True, "connected")
                    delay_s = self.reconnect_s
                    parser = SSEParser(self.max_event_chars)
                    first = True
                    async for chunk in response.aiter_text():
                        self.last_data_s = time.monotonic()
                        batch = self._parse(parser.feed(chunk), first)
                        first = first and not batch
                        if batch:
                            yield batch
                reason = "event stream ended"
            except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: a state body that is not JSON
                reason = _drop_reason(exc)
                if isinstance(exc, EventTooLarge):
                    delay_s = backoff_s  # it connected, but sends what cannot be read: no quicker retry for that
            if on_status:
                on_status(False, reason)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay_s)
                delay_s = self.reconnect_s
            except asyncio.TimeoutError:
                delay_s = min(delay_s * 2, self.max_reconnect_s)

    def _parse(self, messages: list, first_on_connection: bool = False) -> list[Event]:
        batch: list[Event] = []
        for message in messages:
            epoch = message.id.rpartition("-")[0] if message.id else ""
            if epoch and epoch != self.epoch:
                # Another engine process (it restarted): its seq starts at 1 again, nothing of it is seen yet.
                self.epoch, self.last_seq = epoch, 0
            if message.id:
                self.last_event_id = message.id
            try:
                event = event_from_json(json.loads(message.data))
            except (ValueError, TypeError):
                self.skipped_events += 1
                continue
            if first_on_connection and not batch and 0 < event.seq <= self.last_seq:
                # We asked to resume after last_seq and got an older number: not the engine we followed.
                self.engine_restarts += 1
                self.last_seq = event.seq - 1
            if event.seq and event.seq <= self.last_seq:
                continue  # already seen before a reconnect
            self.last_seq = max(self.last_seq, event.seq)
            batch.append(event)
        return batch


async def stream_telemetry(post: Post, client: TelemetryClient, batch_s: float = 0.0) -> None:
    """Follow /strata/events (reconnecting) until cancelled. On every (re)connection `/strata/state` is
    read first and posted, because the engine answering now may not be the one from before (another
    process on the same port, restarted with other switches and reserve); when the event numbers show a
    restarted engine (one that names no instance), the state is read again and posted as a fresh engine's.
    The client belongs to the run: the app closes it.

    With `batch_s`, the events of the reads within `batch_s` of the first one are posted as one batch: a busy
    engine writes many small chunks, each message costs the app more than folding its events does, and the
    screen draws them only at its refresh; every event is kept and in order, each waits at most `batch_s`."""
    loop = asyncio.get_running_loop()
    pending: list = []
    flush_at: list[asyncio.TimerHandle] = []

    def flush() -> None:
        for handle in flush_at:
            handle.cancel()
        flush_at.clear()
        if pending:
            post(TelemetryBatch(pending.copy()))
            pending.clear()

    def on_status(connected: bool, reason: str) -> None:
        flush()  # what came before a drop is posted before the drop is
        post(TelemetryStatus(connected, reason))

    async def on_connect() -> None:
        # Which engine this is, the reducer tells from the snapshot's instance id (strata_tui/state/reducer.py).
        snapshot = await client.state()
        flush()
        post(StateSnapshot(snapshot))

    restarts = client.engine_restarts
    try:
        async for batch in client.events(on_status, on_connect):
            if client.engine_restarts != restarts:
                restarts = client.engine_restarts
                snapshot = await client.state()
                flush()
                post(StateSnapshot(snapshot, fresh_engine=True))
            pending.extend(batch)
            if batch_s <= 0:
                flush()
            elif not flush_at:
                flush_at.append(loop.call_later(batch_s, flush))
    finally:
        flush()


def _drop_reason(exc: BaseException) -> str:
    """Why the stream was dropped, for the status line: the route and the limit it passed, the deadline, or the
    connection's failure in words."""
    if isinstance(exc, EventTooLarge):
        return f"/strata/events: {exc}: dropped"
    if isinstance(exc, (TooLarge, TimeoutError)) and str(exc):
        return str(exc)
    if isinstance(exc, (httpx.HTTPError, OSError)):
        return describe_http_error(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _text(body: bytes) -> str:
    return body[:4096].decode("utf-8", "replace")


def _message_of(body: Any, fallback: str) -> str:
    """The human part of an error body: OpenAI-style {"error": {"message"}}, FastAPI {"detail"}, or text."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail
        if isinstance(detail, dict) and detail.get("message"):
            return str(detail["message"])
        if body.get("message"):
            return str(body["message"])
    return fallback.strip()[:300]
