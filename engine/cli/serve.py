"""`strata-engine serve`: start the engine and the HTTP server; print one ready line; stop cleanly.

Order of events: check the checkpoint's files (config and tensor headers, no weights read: a bad checkpoint is
one line and exit 2 before anything binds) -> bind the socket (so --port 0 has a real port and a bad address
fails before the model loads) -> build the engine client -> start uvicorn on that socket -> once uvicorn is started and
`client.health()` is ready, freeze the heap loaded so far (`freeze_startup_heap`) and print exactly one line on
stdout: `strata-engine: ready at http://HOST:PORT`, then what was set up, as vLLM and llama.cpp print theirs: the KV
capacity in tokens and each device's VRAM books (`ready_line`; the URL is always the fourth word).
All logs go to stderr. SIGTERM/SIGINT: refuse new
requests, abort running ones, end event streams, shut the engine down, exit 0. An engine that dies (sticky
CUDA error): requests get 503 with the reason, then the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable

from engine.api import EngineClient
from engine.config import EngineConfig, add_engine_options, config_from_args
from engine.errors import ConfigError
from engine.orchestration.startup_heap import freeze_startup_heap

log = logging.getLogger("strata.serve")
READY_PREFIX = "strata-engine: ready at"
EXIT_ENGINE_DEAD = 1
EXIT_START_FAILED = 2  # what engine.cli returns for every other StrataError at start
DEAD_GRACE_S = 1.0  # time for in-flight requests to receive their 503 before the process exits
HEALTH_POLL_S = 0.25
# A stop must end within strata-tui's grace (5 s) and the documented 3 s: requests are answered at once, open
# connections get uvicorn_server.GRACEFUL_S to take their last bytes, and the engine thread ENGINE_STOP_WAIT_S
# to leave the step it is in (a long prefill chunk on a CPU takes longer; the thread is a daemon and ends with
# the process).
ENGINE_STOP_WAIT_S = 1.0

ClientFactory = Callable[[EngineConfig], EngineClient]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_options(parser, serving=True)  # --log-level among them: EngineConfig.log_level (a profile sets it)


def run(args: argparse.Namespace, client_factory: ClientFactory | None = None) -> int:
    """Serve until a signal or a dead engine; returns the exit code."""
    _setup_logging(getattr(args, "log_level", "info"))
    config = config_from_args(args)
    warn_if_exposed(config)
    if client_factory is None:
        from engine.model.loader import check_checkpoint
        from engine.model.random_source import RANDOM_PREFIX

        if not config.model.startswith(RANDOM_PREFIX):  # a random:SIZE source is drawn at load: no files
            check_checkpoint(config.model, None if config.quantize == "off" else config.quantize)
    raise_open_files_limit()
    sock = bind_socket(config.host, config.port)
    code = asyncio.run(serve(config, sock, client_factory or default_client_factory))
    if client_factory is None or _engine_thread_busy():
        leave_now(code)
    return code


OPEN_FILES_WANTED = 1 << 16


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files towards the hard one: each connection is a file, and the common soft
    limit of 1,024 would leave the server unable to accept /health (EMFILE) well before its own connection
    limit (uvicorn_server.MAX_CONNECTIONS) answers anything."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            log.info("could not raise the open-files limit from %d to %d", soft, wanted)


def _engine_thread_busy() -> bool:
    """An engine thread still inside a step (ENGINE_STOP_WAIT_S ran out) would be torn down under the
    interpreter's finalization, and the C++ runtime aborts the process on it (exit -6)."""
    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and t.daemon and t.is_alive()]
    if busy:
        log.info("the engine is still inside a step (%s); exiting without waiting for it", busy[0].name)
    return bool(busy)


def leave_now(code: int) -> None:
    """End the process without the interpreter's teardown. Every response is out and the engine has stopped
    (or is stuck inside a step); the teardown would still walk and free the whole heap (the model's included),
    which on a busy CPU host took seconds after the server's last line: past the budget a supervisor
    (strata-tui's `s`) gives a stop before it SIGKILLs. Logs and stdio are flushed first; the OS takes the
    memory back all the same."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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


def ready_line(url: str, snapshot: Any) -> str:
    """The ready line: the URL, the KV capacity in tokens (every slot's context, or the block pool's size where
    slots take KV by use) and each device's VRAM books, from the engine's first state snapshot."""
    parts = [f"{READY_PREFIX} {url}"]
    kv = getattr(snapshot, "kv", None)
    if kv is not None and kv.slots:
        paging = kv.paging
        if paging is not None and paging.pool_blocks:
            capacity = paging.pool_blocks * paging.block_tokens
            shape = (f"a pool of {paging.pool_blocks:,} blocks x {paging.block_tokens} shared by {kv.slots} slots "
                     f"of up to {kv.context_tokens:,}")
        else:
            capacity = kv.slots * kv.context_tokens
            shape = f"{kv.slots} slots x {kv.context_tokens:,}"
        parts.append(f"KV {capacity:,} tokens ({shape}, {kv.storage}, {_mib_text(kv.mib)})")
    for vram in getattr(snapshot, "vram", ()) or ():
        books = ", ".join(f"{label} {_mib_text(value)}" for label, value in (
            ("weights", vram.weights_mib), ("KV", vram.kv_mib), ("graphs", vram.graphs_mib), ("tier", vram.tier_mib),
            ("experts", vram.experts_mib), ("reserve", vram.reserve_mib)) if value or label != "experts")
        parts.append(f"{vram.device or '?'}: {books}, free {_mib_text(vram.free_mib)} of {_mib_text(vram.total_mib)}")
    return " · ".join(parts)


def _mib_text(mib: float) -> str:
    return f"{mib / 1024:,.1f} GiB" if mib >= 10 * 1024 else f"{mib:,.0f} MiB"


def default_client_factory(config: EngineConfig) -> EngineClient:
    from engine.orchestration.async_engine import AsyncEngine

    return AsyncEngine(config)


async def serve(config: EngineConfig, sock: socket.socket, client_factory: ClientFactory) -> int:
    from engine.server.app import create_app
    from engine.server.logs import EventLogger, quiet_monitoring_access
    from engine.server.uvicorn_server import DrainingServer, server_config

    client = client_factory(config)  # AsyncEngine loads in its own thread; health() says "loading" meanwhile
    event_log = EventLogger(client.bus).start()  # warnings and errors reach stderr, not only /strata/events
    quiet_monitoring_access()
    app = create_app(client, config)
    serving = app.state.serving
    uv_config = server_config(app, logging.getLogger().level)

    async def stop_engine() -> None:
        await client.shutdown(wait_s=ENGINE_STOP_WAIT_S)

    server = DrainingServer(uv_config, on_signal=lambda: _spawn(serving.shutdown(stop_engine)))
    exit_code = 0
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        failure = await _wait_ready(server, client, serve_task)
        if failure is None:
            freeze_startup_heap()
            print(ready_line(ready_url(config.host, sock), _first_state(client)), flush=True)
            dead_reason = await _watch_health(client, serve_task)
            if dead_reason is not None:
                log.error("engine is dead (%s); answering 503 for %.1f s, then exiting", dead_reason, DEAD_GRACE_S)
                await asyncio.sleep(DEAD_GRACE_S)
                exit_code = EXIT_ENGINE_DEAD
                await serving.shutdown(stop_engine)
                server.should_exit = True
        else:
            # Same shape as every other start-up error of the CLI: one line, exit 2.
            print(f"strata-engine serve: error: {failure}", file=sys.stderr, flush=True)
            exit_code = EXIT_START_FAILED
            server.should_exit = True
        await serve_task
    finally:
        if not serve_task.done():
            server.should_exit = True
            await serve_task
        await client.shutdown(wait_s=ENGINE_STOP_WAIT_S)
        event_log.stop()
    if serve_task.exception() is not None and exit_code == 0:
        exit_code = 1
    return exit_code


def _first_state(client: EngineClient) -> Any:
    """The engine's state for the ready line; None (the line is then the URL alone) when it cannot give one."""
    try:
        return client.state()
    except Exception as exc:  # a test double without state(), or one that fails: the URL still has to go out
        log.debug("no state for the ready line: %s", exc)
        return None


async def _wait_ready(server: Any, client: EngineClient, serve_task: asyncio.Task) -> str | None:
    """None once uvicorn listens and the engine is ready; else why it never will."""
    while not server.started:
        if serve_task.done():
            return "the HTTP server stopped during start-up"
        await asyncio.sleep(0.02)
    while True:
        health = client.health()
        if health.ready:
            return None
        if health.dead:
            return health.reason.partition(":")[2].strip() or health.reason
        if serve_task.done():
            return "the HTTP server stopped during start-up"
        await asyncio.sleep(0.05)


async def _watch_health(client: EngineClient, serve_task: asyncio.Task) -> str | None:
    """Until the server stops: the reason string as soon as the engine is dead, else None."""
    while not serve_task.done():
        health = client.health()
        if health.dead:
            return health.reason
        await asyncio.sleep(HEALTH_POLL_S)
    return None


def _spawn(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Task] = set()


def _setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
