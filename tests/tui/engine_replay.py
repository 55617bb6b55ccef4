"""A local HTTP server that replays an engine's recorded routes (tests/tui/fixtures/engines/): the adapters
are tested against real HTTP on loopback, with the bytes the engine's own source defines."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

ENGINES = Path(__file__).parent / "fixtures" / "engines"
VLLM = "vllm-0.10-005a810"
SGLANG = "sglang-0.5-00ae9c1"
LLAMACPP = "llamacpp-vendored-0.3.36"


def fixture(name: str) -> str:
    return (ENGINES / name).read_text()


def routes_for(kind: str) -> dict[str, tuple[int, str, str]]:
    """path -> (status, content type, body) of one engine, as its version answers them."""
    text, js = "text/plain; version=0.0.4; charset=utf-8", "application/json"
    if kind == "vllm":
        return {"/health": (200, text, ""), "/version": (200, js, fixture(f"{VLLM}-version.json")),
                "/metrics": (200, text, fixture(f"{VLLM}-metrics.txt")),
                "/v1/models": (200, js, json.dumps({"object": "list", "data": [{"id": "Qwen/Qwen3-8B"}]}))}
    if kind == "sglang":
        return {"/health": (200, text, ""), "/get_server_info": (200, js, fixture(f"{SGLANG}-server-info.json")),
                "/metrics": (200, text, fixture(f"{SGLANG}-metrics.txt"))}
    if kind == "llamacpp":
        return {"/health": (200, js, '{"status":"ok"}'), "/props": (200, js, fixture(f"{LLAMACPP}-props.json")),
                "/slots": (200, js, fixture(f"{LLAMACPP}-slots.json")),
                "/metrics": (200, text, fixture(f"{LLAMACPP}-metrics.txt"))}
    raise ValueError(kind)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def replay_server(routes: dict[str, tuple[int, str, str]]) -> Iterator["Replay"]:
    replay = Replay(routes)
    replay.start()
    try:
        yield replay
    finally:
        replay.stop()


class Replay:
    def __init__(self, routes: dict[str, tuple[int, str, str]]) -> None:
        self.routes = routes
        self.hits: list[str] = []
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        self.hits.append(path)
        if path not in self.routes:
            return Response('{"detail":"Not Found"}', 404, media_type="application/json")
        status, media, body = self.routes[path]
        return Response(body, status, media_type=media)

    def start(self) -> None:
        app = Starlette(routes=[Route("/{path:path}", self._handle)])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("replay server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None
