"""uvicorn's Server with Strata's stop semantics.

On SIGTERM/SIGINT uvicorn stops accepting and waits for open connections, but our streams (a long
generation, /strata/events) would keep theirs open until the graceful timeout. So the first signal also
starts the drain (`on_signal`: abort requests, stop the engine, end the event streams). And uvicorn's
`capture_signals` re-raises a captured signal after its shutdown, which would end the process with -15 instead
of 0: a graceful stop is a success here, so ours (the public method `serve` enters) installs the same handlers
and restores the old ones without raising anything again. Nothing private of uvicorn's Server is read
(tests/engine/server/test_uvicorn_public.py holds that, and that `serve` still goes through `capture_signals`).

And uvicorn's h11 protocol with Strata's bounds on what one connection can hold (BoundedH11Protocol): a deadline
for the request head, a bounded lingering close after an answer given before the body was read, and a
connection limit that never refuses /health. Only public h11 state is read (`their_state`, `trailing_data`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server.guard import MAX_HEAD_BYTES, OVER_LIMIT_KEY

log = logging.getLogger("strata.serve")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose first stop signal also calls `on_signal` on the loop."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers for SIGINT and SIGTERM (its `handle_exit`) while serving, the old ones restored
        after; unlike uvicorn's, the signal is not raised again once the shutdown is done."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can be handled on the main thread only (as uvicorn's own says)
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            log.info("received %s: stopping", signal.Signals(sig).name)
            asyncio.get_event_loop().call_soon_threadsafe(self._on_signal)


HEADER_TIMEOUT_S = 10.0  # a connection that has not sent a whole request head by then is closed
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long
MAX_CONNECTIONS = 1024  # open connections, or running requests, past which requests but /health get 503
GRACEFUL_S = 1  # after a stop signal: how long open connections may still take their last bytes
# After an answer given before the request's body was all read (a refusal), the connection closes; its rest is
# read and dropped first, so that the client, still sending, reads the answer instead of a reset. Bounded: a
# chunked body has no end to wait for.
LINGER_S = 10.0
LINGER_CHUNKED_BYTES = 1 << 20  # what is dropped of a chunked body's rest (a sized one: its declared length)


def server_config(app: Any, log_level: int | str = logging.INFO) -> uvicorn.Config:
    """uvicorn's settings for the Strata server: its connection limits (documented in docs/API.md). The
    connection limit is Strata's own (BoundedH11Protocol): uvicorn's would answer /health 503 too."""
    return uvicorn.Config(app, log_config=None, log_level=log_level, lifespan="on", http=BoundedH11Protocol,
                          timeout_graceful_shutdown=GRACEFUL_S, timeout_keep_alive=KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, limit_concurrency=None)


class _ClosingTransport:
    """The connection's transport as uvicorn sees it: the same, except that `close()` asks the protocol how to
    close (uvicorn closes at once after a `Connection: close` answer, which resets a client still sending)."""

    def __init__(self, transport: asyncio.Transport, on_close: Callable[[], None]) -> None:
        self._transport = transport
        self._on_close = on_close
        self._closing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._on_close()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with Strata's bounds on a connection:
    - a deadline for the request head: uvicorn arms its keep-alive timer only after a response, so a connection
      that sends nothing, or half a request line, was held open forever;
    - a lingering close after an answer given before the body was all read (LINGER_S, LINGER_CHUNKED_BYTES):
      the rest is dropped unparsed, then the connection closes, however much more the client would send;
    - the connection limit: past MAX_CONNECTIONS, requests get a JSON 503 from the guard, but /health is
      answered (a liveness probe that got 503 would restart a healthy engine)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routes = self.app
        self.app = self._app_with_load
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_left: int | None = None  # bytes still to drop before closing; None: not lingering
        self._linger_timer: asyncio.TimerHandle | None = None

    async def _app_with_load(self, scope: dict, receive: Any, send: Any) -> None:
        """The app, told (scope's extensions) whether the server is past its connection limit: the guard
        refuses every route but the open ones then."""
        over = len(self.connections) > MAX_CONNECTIONS or len(self.tasks) > MAX_CONNECTIONS
        scope.setdefault("extensions", {})[OVER_LIMIT_KEY] = over
        await self._routes(scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real_transport = transport
        super().connection_made(_ClosingTransport(transport, self._close))  # type: ignore[arg-type]
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:  # the rest of a body already answered: dropped, never parsed
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self._real_transport.close()
            return
        super().data_received(data)
        waiting_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting_head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        elif waiting_head and self._head_timer is None and self.conn.trailing_data[0]:
            self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)  # part of the next head

    def _close(self) -> None:
        """uvicorn closes the connection. With the request's body still arriving (the answer came first), the
        answer is sent, our side shut, and the rest read and dropped until the client closes or a bound."""
        transport = self._real_transport
        if self.conn.their_state is not h11.SEND_BODY or transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        self._linger_left = _declared_length(self.headers or []) or LINGER_CHUNKED_BYTES
        transport.write_eof()
        transport.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _head_late(self) -> None:
        self._head_timer = None
        idle = self.cycle is None or self.cycle.response_complete  # no request, or the last one answered
        if self.conn.their_state is h11.IDLE and idle and not self.transport.is_closing():
            log.info("closing a connection from %s that sent no whole request head in %.0f s",
                     self.client, HEADER_TIMEOUT_S)
            self.transport.close()


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length, None for a chunked body (or none)."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and len(value) <= 12:
            return int(value)
    return None
