"""Who may call the server, and with what: one ASGI middleware in front of every route.

Checks run before routing and before a body byte is read, cheapest first:
- Host (no API key only): the Host header names the bound address or a loopback name. A web page that
  rebinds its own DNS name to 127.0.0.1 sends its own name as Host, so it is refused (DNS rebinding).
- API key: with `--api-key`, every route but `/health` needs `Authorization: Bearer KEY`.
- Origin (no API key only): a browser's cross-origin request to a route that changes something is
  refused; non-browser clients send no Origin.
- Content-Type: a request with a body must say `application/json` (415 otherwise): a form or a
  `text/plain` body is what a page can send cross-origin without asking first.
- Body size: a Content-Length above the limit is 413 at once; a chunked body is counted as it arrives.
- Head size: a request head past MAX_HEAD_BYTES is 431 (h11 refuses only a head that arrives in pieces).
- Load: past the server's connection limit (uvicorn_server.BoundedH11Protocol says so in the scope), 503 with
  Retry-After for every route but /health.
An answer given before the request's body was all read carries `Connection: close`: the connection cannot
serve on without reading the rest, and uvicorn_server drops that rest (bounded) and closes it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from engine.config import EngineConfig
from engine.server.auth import check_bearer, is_loopback
from engine.server.errors import ApiError
from engine.server.first_of import result_unless
from engine.server.protocol import MAX_DECIMAL_DIGITS

log = logging.getLogger("strata.server")
BODY_STALL_S = 30.0  # a request body that stops arriving for this long: 408
# A body that keeps arriving, but slowly: it must be in by BODY_BASE_S plus a second per BODY_MIN_RATE_BYTES_S
# received (a byte every few seconds never stalls, and held a connection for ever): 408.
BODY_BASE_S = 10.0
BODY_MIN_RATE_BYTES_S = 16 << 10
MAX_HEAD_BYTES = 64 << 10  # a request head (request line and headers) past this: 431
OVER_LIMIT_KEY = "strata.over_connection_limit"  # scope["extensions"]: set by uvicorn_server's protocol
OVER_LIMIT_RETRY_S = 1
SEND_STALL_S = 30.0  # a response the client stops reading for this long: the request is aborted
OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class SendStalled(Exception):
    """The client took no response bytes for SEND_STALL_S."""


class BodyTooLarge(ApiError):
    def __init__(self, limit_bytes: int, got: str) -> None:
        super().__init__(413, f"request body is {got}; the limit is {limit_bytes} bytes (--max-body-mib)",
                         code="body_too_large")


class RequestGuard:
    """ASGI middleware: Host, API key, Origin, Content-Type and body-size checks (module docstring)."""

    def __init__(self, app: Any, config: EngineConfig) -> None:
        self.app = app
        self.api_key = config.api_key
        self.bound_host = config.host.strip("[]").lower()
        self.max_body_bytes = config.max_body_mib << 20

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        body = _BodyState(_has_body(headers))
        send = _closing_unless_read(send, body)
        try:
            if _head_bytes(scope) > MAX_HEAD_BYTES:
                raise ApiError(431, f"the request head is {_head_bytes(scope)} bytes; the limit is {MAX_HEAD_BYTES}",
                               code="head_too_large")
            if scope.get("extensions", {}).get(OVER_LIMIT_KEY) and scope["path"] not in OPEN_PATHS:
                raise ApiError(503, "the server has as many connections open as it takes; retry shortly",
                               type="server_unavailable", code="too_many_connections",
                               headers={"Retry-After": str(OVER_LIMIT_RETRY_S)})
            self.check(scope["method"], scope["path"], headers)
        except ApiError as err:
            await _answer(err, send)
            return
        stalled = asyncio.Event()  # set when the client stops taking the response: it reads as a disconnect
        try:
            await self.app(scope, self._counting(receive, stalled, body), self._stall_checked(send, stalled))
        except SendStalled:
            # Its request was aborted when the stream closed; uvicorn drops the unfinished connection.
            log.info("%s %s: the client stopped reading for %.0f s; the request was aborted",
                     scope["method"], scope["path"], SEND_STALL_S)

    def check(self, method: str, path: str, headers: dict[str, str]) -> None:
        """Raise the ApiError that answers this request, or return when it may go on to its route."""
        if not self.api_key:
            self._check_host(headers.get("host", ""))
        if path not in OPEN_PATHS:
            check_bearer(headers.get("authorization"), self.api_key)
        if method in _SAFE_METHODS:
            return
        if not self.api_key:
            self._check_origin(headers.get("origin"), headers.get("host", ""))
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, f"{method} bodies must be JSON: send 'Content-Type: application/json' "
                                f"(got {media_type or 'no Content-Type'})", code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.isascii() and length.isdigit():
            if len(length) > MAX_DECIMAL_DIGITS or int(length) > self.max_body_bytes:  # no int() of 5000 digits
                raise BodyTooLarge(self.max_body_bytes, f"{length[:24]} bytes")

    def _check_host(self, host_header: str) -> None:
        name = _host_name(host_header)
        if name == self.bound_host or is_loopback(name):
            return
        if self.bound_host in _WILDCARD_HOSTS and _is_ip(name):
            return  # bound on every address: any address literal is one of ours; a DNS name is not
        raise ApiError(400, f"Host {host_header!r} is not this server's address; use {self.bound_host} or a "
                            f"loopback name (or set --api-key to serve other names)", param="Host",
                       code="host_not_allowed")

    def _check_origin(self, origin: str | None, host_header: str) -> None:
        if origin is None:
            return
        parts = urlsplit(origin)
        if origin != "null" and parts.netloc.lower() == host_header.lower():
            return  # same origin: a page served by this very server
        raise ApiError(403, f"cross-origin request from {origin!r} refused (set --api-key to allow clients "
                            f"that hold the key)", param="Origin", code="cross_origin_refused")

    def _counting(self, receive: Receive, stalled: asyncio.Event, body: "_BodyState") -> Receive:
        """`receive` that refuses a body (chunked, or lying about its length) once it passes the limit, one
        that stops arriving for BODY_STALL_S (408: a half-sent upload held its connection forever), and one
        that arrives slower than BODY_MIN_RATE_BYTES_S after BODY_BASE_S (408: a trickle never stalls)."""
        seen = 0
        limit = self.max_body_bytes
        started: float | None = None

        async def wrapped() -> dict[str, Any]:
            nonlocal seen, started
            if body.done:  # after the body only a disconnect comes: the client's, or a stalled send's
                return await _first_of(receive, stalled)
            now = asyncio.get_running_loop().time()
            started = now if started is None else started
            due_in_s = started + BODY_BASE_S + seen / BODY_MIN_RATE_BYTES_S - now
            try:
                # a deadline on this task, not wait_for's task per message: a large body arrives in hundreds
                async with asyncio.timeout(max(0.0, min(BODY_STALL_S, due_in_s))):
                    message = await receive()
            except TimeoutError:
                if due_in_s <= BODY_STALL_S:
                    raise ApiError(408, f"the request body arrived too slowly ({seen} bytes in {now - started:.0f}"
                                        f" s; at least {BODY_MIN_RATE_BYTES_S} bytes a second after the first "
                                        f"{BODY_BASE_S:.0f} s)", code="body_timeout") from None
                raise ApiError(408, f"the request body stopped arriving for {BODY_STALL_S:.0f} s (after {seen} "
                                    f"bytes)", code="body_timeout") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit, f"over {seen} bytes")
                body.done = not message.get("more_body", False)
            else:
                body.done = True
            return message

        return wrapped

    @staticmethod
    def _stall_checked(send: Send, stalled: asyncio.Event) -> Send:
        """`send` that gives up on a body message the client does not take for SEND_STALL_S: a streaming
        client that stopped reading (its socket buffers full) otherwise kept its generation running. The
        route's disconnect watchers then see a disconnect, and abort the request as for one."""

        async def wrapped(message: dict[str, Any]) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                await asyncio.wait_for(send(message), SEND_STALL_S)
            except asyncio.TimeoutError:
                stalled.set()
                raise SendStalled() from None

        return wrapped


class _BodyState:
    """Whether the request's body has been read to its end (a request without one has)."""

    __slots__ = ("done",)

    def __init__(self, has_body: bool) -> None:
        self.done = not has_body


def _has_body(headers: dict[str, str]) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("0", "")


def _closing_unless_read(send: Send, body: _BodyState) -> Send:
    """`send` that marks an answer `Connection: close` when the request's body was not read to its end."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not body.done:
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return wrapped


def _head_bytes(scope: Scope) -> int:
    """The size of the request head as sent (request line and header lines)."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", [])) + 2


async def _first_of(receive: Receive, stalled: asyncio.Event) -> dict[str, Any]:
    """The next message, or a disconnect once the send stalled (whichever comes first)."""
    received, message = await result_unless(receive(), stalled)
    return message if received else {"type": "http.disconnect"}


def _host_name(host_header: str) -> str:
    """The name in a Host header, without the port: '[::1]:8000' -> '::1', 'a.b:80' -> 'a.b'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


async def _answer(err: ApiError, send: Send) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
