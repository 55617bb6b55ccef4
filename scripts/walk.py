"""Count the files a reader walks through, from the running code: docs/ARCHITECTURE.md's three walks.

    python scripts/walk.py [completions|reserve|telemetry ...]

Each walk runs the real thing on CPU (the embedded model behind a real server on a loopback port; the TUI in
attach mode under Textual's pilot) with a profiler that, at each of the walk's stops (a function or a whole
module), notes the files of engine/ and strata_tui/ on the call stack: the walk's path is those files in the
order first met. It also counts every file any call entered between the start and the last stop, in any
thread (helpers that return before the next stop included, and whatever else ran meanwhile). Stops:

  completions  POST /v1/completions -> the request handed to the engine thread -> the first token sampled
  reserve      `+` on the monitor (the file binding it) -> the action -> the HTTP POST -> VramBudget.set_reserve
  telemetry    a SlotEvent published -> its SSE frame -> parsed back in the TUI -> the slots table's cells
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PACKAGES = ("engine", "strata_tui")


class Walk:
    """Files on the stack at each stop, over every thread, while armed."""

    def __init__(self, stops: list[Callable[..., Any] | ModuleType]) -> None:
        self.codes: set[CodeType] = set()
        self.files: set[str] = set()
        for stop in stops:
            if isinstance(stop, ModuleType):
                self.files.add(str(Path(stop.__file__).resolve()))
            else:
                self.codes.add(inspect.unwrap(stop).__code__)
        self.seen: dict[str, None] = {}  # ordered set: first met first
        self.hit: set[CodeType | str] = set()
        self.lock = threading.Lock()
        self.armed = False  # the profiler is on in every thread from the start; stops count once armed
        self.last = stops[-1]
        self.entered: dict[str, None] = {}  # every file a call entered while armed, in any thread

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.armed:
            return
        code = frame.f_code
        rel = _relative(code.co_filename)
        if rel is not None and rel not in self.entered:
            with self.lock:
                self.entered.setdefault(rel, None)
        key = code if code in self.codes else code.co_filename if code.co_filename in self.files else None
        if key is None or (key == self._last_key() and self.missed() > 1):
            return  # the last stop counts once every other stop was reached
        stack = []
        while frame is not None:
            stack.append(frame.f_code.co_filename)
            frame = frame.f_back
        with self.lock:
            self.hit.add(key)
            for name in reversed(stack):
                rel = _relative(name)
                if rel is not None:
                    self.seen.setdefault(rel, None)
            if key == self._last_key():
                self.armed = False  # the walk ends at its last stop

    @functools.cached_property
    def _last(self) -> CodeType | str:
        if isinstance(self.last, ModuleType):
            return str(Path(self.last.__file__).resolve())
        return inspect.unwrap(self.last).__code__

    def _last_key(self) -> CodeType | str:
        return self._last

    def install(self) -> None:
        """Profile every thread started from now on (the engine's and the server's)."""
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def __enter__(self) -> "Walk":
        self.armed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.armed = False

    def first(self, path: str) -> None:
        """A file the walk starts in that is on no stack (a key binding is a declaration, not a call)."""
        self.seen = {path: None, **self.seen}

    def missed(self) -> int:
        return len(self.codes | self.files) - len(self.hit)


@functools.lru_cache(maxsize=None)
def _relative(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in PACKAGES else None


class _Server:
    """A real AsyncEngine on CPU behind uvicorn on a loopback port, in a thread."""

    def __init__(self) -> None:
        from engine.cli.serve import bind_socket
        from engine.config import EngineConfig
        from engine.orchestration.async_engine import AsyncEngine
        from engine.server.app import create_app

        import uvicorn

        self.config = EngineConfig(device="cpu", batch=2, context=512)
        self.client = AsyncEngine(self.config)
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.client, self.config), log_config=None))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        deadline = time.monotonic() + 180
        while not (self.server.started and self.client.health().ready):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start: {self.client.health().reason}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        asyncio.run(self.client.shutdown())


def completions() -> Walk:
    import httpx

    import engine.exec.sampler as sampler
    from engine.orchestration.async_engine import AsyncEngine
    from engine.server.serving import Serving

    walk = Walk([Serving.completion, AsyncEngine._submit, sampler.sample_with_drafts])
    walk.install()
    with _Server() as server, walk:
        reply = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"model": server.config.model, "prompt": "Hello", "max_tokens": 1})
        reply.raise_for_status()
    return walk


def reserve() -> Walk:
    from engine.exec.kv.vram_budget import VramBudget
    from engine.orchestration.async_engine import AsyncEngine
    from strata_tui.app import create_app
    from strata_tui.controls import Controls
    from strata_tui.telemetry_client import TelemetryClient

    walk = Walk([Controls.reserve, TelemetryClient.set_vram_reserve, AsyncEngine.set_vram_reserve,
                 VramBudget.set_reserve])
    walk.install()

    async def press(url: str, config_dir: str) -> str:
        app = create_app(config_dir=config_dir, attach_url=url, sampler_factory=None)
        async with app.run_test(size=(160, 50)) as pilot:
            await _until(pilot, lambda: app.view.telemetry_connected)
            with walk:
                await pilot.press("plus")
                await _until(pilot, lambda: app.view.reserve_note == "applied live")
            return inspect.getsourcefile(type(app.screen))

    with _Server() as server, tempfile.TemporaryDirectory() as config_dir:
        screen_file = asyncio.run(press(server.url, config_dir))
    walk.first(_relative(screen_file))
    return walk


def telemetry() -> Walk:
    import engine.server.sse as sse
    from engine.telemetry import EventBus, event_from_json
    from strata_tui.app import create_app
    from strata_tui.widgets.slots_table import SlotsTable

    import httpx

    walk = Walk([EventBus.publish, sse.sse_event, event_from_json, SlotsTable._apply])
    walk.install()

    async def watch(url: str, config_dir: str) -> None:
        app = create_app(config_dir=config_dir, attach_url=url, sampler_factory=None)
        async with app.run_test(size=(160, 50)) as pilot:
            await _until(pilot, lambda: app.view.telemetry_connected)
            with walk:
                async with httpx.AsyncClient() as http:
                    await http.post(url + "/v1/completions", timeout=120,
                                    json={"model": "builtin:strata-tiny", "prompt": "Hello", "max_tokens": 8})
                await _until(pilot, lambda: not walk.armed)

    with _Server() as server, tempfile.TemporaryDirectory() as config_dir:
        asyncio.run(watch(server.url, config_dir))
    return walk


async def _until(pilot: Any, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError("the walk did not reach its last stop")
        await pilot.pause(0.05)


WALKS = {"completions": completions, "reserve": reserve, "telemetry": telemetry}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/walk.py", description=__doc__.split("\n")[0])
    parser.add_argument("walks", nargs="*", metavar="WALK", help=f"which walks (default all): {', '.join(WALKS)}")
    names = parser.parse_args(argv).walks or list(WALKS)
    unknown = [name for name in names if name not in WALKS]
    if unknown:
        parser.error(f"unknown walk {unknown[0]!r}: the walks are {', '.join(WALKS)}")
    for name in names:
        walk = WALKS[name]()
        files = list(walk.seen)
        print(f"{name}: {len(files)} files on the path (the stacks at its stops)"
              + (f"; {walk.missed()} stops never reached" if walk.missed() else ""))
        for path in files:
            print(f"  {path}")
        entered = sorted(walk.entered)
        print(f"{name}: {len(entered)} files entered by any call on the way, in any thread: {' '.join(entered)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
