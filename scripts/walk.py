"""Count the product files the data passes through, from the running code: docs/ARCHITECTURE.md's three walks,
checked against docs/STYLE.md's limits by tests/test_walks.py.

    python scripts/walk.py [completions|reserve|telemetry ...]

Each walk runs the real thing on CPU (the embedded model behind a real server on a loopback port; the TUI in attach
mode under Textual's pilot) under a profiler in every thread, and follows its data from stop to stop
(scripts/walk_tracer.py says which files count: those the data comes down the stack through, and the stations
that made what reached the end). Stops:

  completions  POST /v1/completions -> handed to the engine thread -> the first token sampled -> kept by the
               scheduler -> handed back to the server
  reserve      `+` on the monitor (the file binding it) -> the action -> the HTTP POST -> VramBudget.set_reserve
               (a number of MiB: every stop a bridge)
  telemetry    a SlotEvent made -> published -> its SSE frame -> parsed back in the TUI (a bridge) -> the reducer ->
               folded into the monitor's state -> the slots table's cells

The script also prints every file any call entered between the first stop and the last, in any thread (the
helpers, and whatever else ran meanwhile): not the path, a bound on it.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from walk_tracer import Walk, product_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "The capital of France is"


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
    from engine.core.scheduler import Scheduler
    from engine.orchestration.async_engine import AsyncEngine
    from engine.server.serving import Serving

    walk = Walk([Serving.completion, AsyncEngine._submit, sampler.sample_with_drafts, Scheduler.update,
                 AsyncEngine._deliver, Serving._observe])
    walk.install()
    with _Server() as server, walk:
        reply = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"model": server.config.model, "prompt": PROMPT, "max_tokens": 1})
        reply.raise_for_status()
    return walk


def reserve() -> Walk:
    from engine.exec.kv.vram_budget import VramBudget
    from engine.orchestration.async_engine import AsyncEngine
    from strata_tui.actions.controls import Controls
    from strata_tui.app import create_app
    from strata_tui.engine_io.telemetry_client import TelemetryClient

    stops = [Controls.reserve, TelemetryClient.set_vram_reserve, AsyncEngine.set_vram_reserve, VramBudget.set_reserve]
    walk = Walk(stops, bridges=tuple(stops))  # the data is a number of MiB: met at each stop
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
    walk.first(product_path(screen_file))
    return walk


def telemetry() -> Walk:
    import engine.server.sse as sse
    from engine.orchestration.state import slot_event
    from engine.telemetry import EventBus, event_from_json
    from strata_tui.app import create_app
    from strata_tui.state.monitor_state import MonitorState
    from strata_tui.state.reducer import reduce
    from strata_tui.widgets.slots_table import SlotsTable

    import httpx

    walk = Walk([slot_event, EventBus.publish, sse.sse_event, event_from_json, reduce, MonitorState.apply,
                 SlotsTable._apply], bridges=(event_from_json,), born=True)  # read back from the socket in the TUI
    walk.install()

    async def watch(url: str, config_dir: str) -> None:
        app = create_app(config_dir=config_dir, attach_url=url, sampler_factory=None)
        async with app.run_test(size=(160, 50)) as pilot:
            await _until(pilot, lambda: app.view.telemetry_connected)
            with walk:
                async with httpx.AsyncClient() as http:
                    await http.post(url + "/v1/completions", timeout=120,
                                    json={"model": "builtin:strata-tiny", "prompt": PROMPT, "max_tokens": 8})
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
        files = walk.path
        print(f"{name}: {len(files)} files on the path"
              + (f"; {walk.missed()} stops never reached" if walk.missed() else ""))
        for path in files:
            print(f"  {path}" + (f"  ({walk.stations[path]})" if path in walk.stations else ""))
        entered = sorted(walk.entered)
        print(f"{name}: {len(entered)} files entered by any call on the way, in any thread: {' '.join(entered)}")
        if walk.missed():
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
