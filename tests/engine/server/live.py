"""A real uvicorn server on a loopback socket (port 0), run in a thread, for tests that speak real HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

from engine.cli.serve import bind_socket


class LiveServer:
    """`with LiveServer(app) as url:` serves `app` on 127.0.0.1:<free port> until the block ends."""

    def __init__(self, app: Any, startup_timeout_s: float = 20.0, config: uvicorn.Config | None = None) -> None:
        self.app = app
        self.startup_timeout_s = startup_timeout_s
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(config or uvicorn.Config(app, log_config=None, lifespan="on",
                                                              timeout_graceful_shutdown=3))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="live-uvicorn", daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        self.loop.close()

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)
