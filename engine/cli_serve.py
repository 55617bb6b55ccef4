"""`strata-engine serve`: start the engine and the HTTP server; print one ready line; stop cleanly.

Order of events: bind the socket (so --port 0 has a real port and a bad address fails before the model
loads) -> build the engine client -> start uvicorn on that socket -> once uvicorn is started and
`client.health()` is ready, print exactly `strata-engine: ready at http://HOST:PORT` on stdout. All logs go
to stderr. SIGTERM/SIGINT: refuse new requests, abort running ones, end event streams, shut the engine down,
exit 0. An engine that dies (sticky CUDA error): requests get 503 with the reason, then the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import signal
import socket
import sys
from typing import Any, Callable

from engine.api import EngineClient
from engine.cli_options import add_engine_options, config_from_args
from engine.config import EngineConfig
from engine.errors import ConfigError

log = logging.getLogger("strata.serve")
READY_PREFIX = "strata-engine: ready at"
EXIT_ENGINE_DEAD = 1
DEAD_GRACE_S = 1.0  # time for in-flight requests to receive their 503 before the process exits
HEALTH_POLL_S = 0.25

ClientFactory = Callable[[EngineConfig], Any]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_options(parser, serving=True)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="stderr log level (default info)")


def run(args: argparse.Namespace, client_factory: ClientFactory | None = None) -> int:
    """Serve until a signal or a dead engine; returns the exit code."""
    _setup_logging(getattr(args, "log_level", "info"))
    config = config_from_args(args)
    warn_if_exposed(config)
    sock = bind_socket(config.host, config.port)
    return asyncio.run(serve(config, sock, client_factory or default_client_factory))


def warn_if_exposed(config: EngineConfig) -> None:
    from engine.server.auth import is_loopback

    if not is_loopback(config.host) and not config.api_key:
        print(f"strata-engine serve: WARNING: binding {config.host} without --api-key: anyone who can reach "
              f"this address can use the API and change switches", file=sys.stderr, flush=True)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound socket for host:port (port 0: the OS picks a free one). Errors name the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ConfigError("host/port", f"{host}:{port}", f"cannot bind: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def ready_url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}"


def default_client_factory(config: EngineConfig) -> EngineClient:
    from engine.async_engine import AsyncEngine

    return AsyncEngine(config)


async def serve(config: EngineConfig, sock: socket.socket, client_factory: ClientFactory) -> int:
    import uvicorn

    from engine.server.app import create_app

    client = client_factory(config)
    if inspect.isawaitable(client):
        client = await client
    start = getattr(client, "start", None)
    if start is not None:
        result = start()
        if inspect.isawaitable(result):
            await result
    app = create_app(client, config)
    serving = app.state.serving
    uv_config = uvicorn.Config(app, log_config=None, log_level=logging.getLogger().level,
                               timeout_graceful_shutdown=5, lifespan="on")
    server = _Server(uv_config, on_signal=lambda: _spawn(serving.begin_shutdown()))
    exit_code = 0
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        if await _wait_ready(server, client, serve_task):
            print(f"{READY_PREFIX} {ready_url(config.host, sock)}", flush=True)
            dead_reason = await _watch_health(client, serve_task)
            if dead_reason is not None:
                log.error("engine is dead (%s); answering 503 for %.1f s, then exiting", dead_reason, DEAD_GRACE_S)
                await asyncio.sleep(DEAD_GRACE_S)
                exit_code = EXIT_ENGINE_DEAD
                await serving.begin_shutdown()
                server.should_exit = True
        else:
            exit_code = EXIT_ENGINE_DEAD
            server.should_exit = True
        await serve_task
    finally:
        if not serve_task.done():
            server.should_exit = True
            await serve_task
        await client.shutdown()
    if serve_task.exception() is not None and exit_code == 0:
        exit_code = 1
    return exit_code


async def _wait_ready(server: Any, client: EngineClient, serve_task: asyncio.Task) -> bool:
    """True once uvicorn listens and the engine is ready; False when either gives up first."""
    while not server.started:
        if serve_task.done():
            return False
        await asyncio.sleep(0.02)
    while True:
        health = client.health()
        if health.ready:
            return True
        if health.reason.startswith("dead"):
            log.error("engine failed to start: %s", health.reason)
            return False
        if serve_task.done():
            return False
        await asyncio.sleep(0.05)


async def _watch_health(client: EngineClient, serve_task: asyncio.Task) -> str | None:
    """Until the server stops: the reason string as soon as the engine is dead, else None."""
    while not serve_task.done():
        health = client.health()
        if not health.ready and health.reason.startswith("dead"):
            return health.reason
        await asyncio.sleep(HEALTH_POLL_S)
    return None


def _spawn(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Task] = set()


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, plus: a signal also starts our drain (abort requests, end event streams), and a
        graceful stop exits 0 instead of re-raising the signal after shutdown."""

        def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
            super().__init__(config)
            self._on_signal = on_signal

        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            if first:
                log.info("received %s: stopping", signal.Signals(sig).name)
                asyncio.get_event_loop().call_soon_threadsafe(self._on_signal)

    return Server


def _Server(config: Any, on_signal: Callable[[], None]) -> Any:
    return _server_class()(config, on_signal)


def _setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
