"""uvicorn's Server with Strata's stop semantics.

On SIGTERM/SIGINT uvicorn stops accepting and waits for open connections, but our streams (a long
generation, /strata/events) would keep theirs open until the graceful timeout. So the first signal also
starts the drain (`on_signal`: abort requests, stop the engine, end the event streams). And uvicorn
re-raises a captured signal after its shutdown, which would end the process with -15 instead of 0: a
graceful stop is a success here, so it does not.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("strata.serve")


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose first stop signal also calls `on_signal` on the loop."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if first:
            log.info("received %s: stopping", signal.Signals(sig).name)
            asyncio.get_event_loop().call_soon_threadsafe(self._on_signal)


HEADER_TIMEOUT_S = 10.0  # a connection that has not sent a whole request head by then is closed
MAX_HEAD_BYTES = 64 << 10  # h11's limit on a request head (request line and headers)
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long
MAX_CONNECTIONS = 1024  # open connections plus running requests; beyond it uvicorn answers 503
GRACEFUL_S = 1  # after a stop signal: how long open connections may still take their last bytes


def server_config(app: Any, log_level: int | str = logging.INFO) -> uvicorn.Config:
    """uvicorn's settings for the Strata server: its connection limits (documented in docs/API.md)."""
    return uvicorn.Config(app, log_config=None, log_level=log_level, lifespan="on", http=HeadTimeoutH11Protocol,
                          timeout_graceful_shutdown=GRACEFUL_S, timeout_keep_alive=KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, limit_concurrency=MAX_CONNECTIONS)


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request head: uvicorn arms its keep-alive timer only
    after a response, so a connection that sends nothing, or half a request line, was held open forever."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def data_received(self, data: bytes) -> None:
        rest = self._past_answered_body(data)
        if rest is None:  # all of it belongs to a body already answered, and more of that body is to come
            self._unset_keepalive_if_required()
            return
        if rest or len(rest) == len(data):  # bytes for h11, or nothing dropped
            super().data_received(rest)
        else:  # that body ended exactly here: h11 hands over its end and the connection waits for a head
            self._unset_keepalive_if_required()
            self.handle_events()
        waiting_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting_head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        elif waiting_head and self._head_timer is None and (self.conn.trailing_data[0]
                                                             or self.timeout_keep_alive_task is None):
            # part of the next head, or nothing and no keep-alive timer: the rest of a body refused before it
            # was all read (engine.server.app._body) ended the last request after its answer, which armed none
            self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def _past_answered_body(self, data: bytes) -> bytes | None:
        """What of `data` follows the body of a request already answered (a body refused from its first bytes,
        engine.server.app._large_body): h11 would buffer and copy every byte of that body's rest only for
        uvicorn to drop it, the most work the event loop did under senders of large refused bodies. So the
        rest's length is counted off h11's Content-Length reader here and the bytes are dropped unread. None:
        all of `data` was dropped and the body goes on. Anything else (no such body, a chunked one, bytes h11
        still holds, another h11 whose reader has no `_remaining`) is left to h11 whole."""
        conn = self.conn
        if conn.our_state is not h11.DONE or conn.their_state is not h11.SEND_BODY:
            return data
        reader = getattr(conn, "_reader", None)
        remaining = getattr(reader, "_remaining", None)
        if type(remaining) is not int or remaining <= 0 or conn.trailing_data[0]:
            return data
        dropped = min(remaining, len(data))
        reader._remaining = remaining - dropped  # type: ignore[union-attr]
        if reader._remaining:  # type: ignore[union-attr]
            return None
        return data[dropped:]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_late(self) -> None:
        self._head_timer = None
        idle = self.cycle is None or self.cycle.response_complete  # no request, or the last one answered
        if self.conn.their_state is h11.IDLE and idle and not self.transport.is_closing():
            log.info("closing a connection from %s that sent no whole request head in %.0f s",
                     self.client, HEADER_TIMEOUT_S)
            self.transport.close()
