"""Measure strata-tui's own CPU use and its event-to-screen latency with busy slots.

The app runs headless (Textual's pilot: the full compose/render pipeline, output to no terminal) and
launches an engine: by default tests/tui/fake_engine.py publishing a steady decode load (SLOTS slots x HZ
slot events per second), so the figure does not depend on how fast this machine's engine is; with
`--real-engine` the real strata-engine on CPU serving SLOTS concurrent long generations.

CPU: the TUI process's CPU time (time.process_time: every thread of this process, not the engine child)
over the measuring window, as a percentage of one core. Latency: for every event, the time from its publish
stamp (`ts`, set by the engine's bus) to the end of the first screen refresh after it was folded into the
state (call_after_refresh), on one clock (both processes on this machine).

    .venv/bin/python benchmarks/bench_tui.py                       # 6 slots x 30 Hz, default refresh
    .venv/bin/python benchmarks/bench_tui.py --slots 6 --hz 60 --seconds 20
    .venv/bin/python benchmarks/bench_tui.py --real-engine --seconds 20
    .venv/bin/python benchmarks/bench_tui.py --idle --seconds 30   # an engine with nothing to say: the idle cost
    .venv/bin/python benchmarks/bench_tui.py --real-engine --idle --kv-pool reserved   # no pool to read
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strata_tui.app import create_app  # noqa: E402
from strata_tui.profiles.profile import Profile  # noqa: E402
from strata_tui.profiles.store import ProfileStore  # noqa: E402
from strata_tui.widgets.slots_table import SlotsTable  # noqa: E402

FAKE_ENGINE = [sys.executable, str(ROOT / "tests" / "tui" / "fake_engine.py")]


def instrument(latencies_s: list[float]) -> None:
    """Time every event from its publish stamp to the end of the first screen refresh that painted it.

    Events are folded into state when their batch arrives and drawn on the slots table's next refresh tick (the
    table reads its slice of the state on its own tick); so each event's latency is: network + parse + wait for
    the tick + redraw + paint."""
    from strata_tui.app import StrataApp

    from strata_tui.engine_io.messages import TelemetryBatch

    pending_ts: list[float] = []
    on_news = StrataApp.on_engine_news

    def on_engine_news(self, message) -> None:
        if isinstance(message, TelemetryBatch):
            pending_ts.extend(e.ts for e in message.events if e.ts)
        on_news(self, message)

    StrataApp.on_engine_news = on_engine_news
    original = SlotsTable.redraw

    def redraw(self: SlotsTable, force: bool = False) -> None:
        before = self._seen_version
        original(self, force)
        if self._seen_version == before or not pending_ts:
            return
        drawn = list(pending_ts)
        pending_ts.clear()

        def painted() -> None:
            now = time.time()
            latencies_s.extend(now - ts for ts in drawn)

        self.call_after_refresh(painted)

    SlotsTable.redraw = redraw


async def send_load(url: str, slots: int, max_tokens: int) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> None:
            body = {"model": model, "prompt": [7 + i] * 32, "max_tokens": max_tokens, "temperature": 0.0}
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 200:
                print(f"request {i}: HTTP {response.status_code}: {response.text[:200]}", file=sys.stderr)
        await asyncio.gather(*(one(i) for i in range(slots)))


async def run(args: argparse.Namespace) -> dict:
    config_dir = Path(tempfile.mkdtemp(prefix="strata-tui-bench-"))
    import os

    if args.real_engine:
        from engine.model.random_checkpoint import write_random_checkpoint

        model = args.model or str(write_random_checkpoint(config_dir / "ckpt", mtp_layout="deepseek"))
        profile = Profile("bench").with_engine(model=model, device="cpu", batch=args.slots, context=4096,
                                               kv_pool=args.kv_pool)
        program = None
    else:
        if args.idle:
            os.environ.pop("FAKE_ENGINE_BUSY", None)
        else:
            os.environ["FAKE_ENGINE_BUSY"] = f"{args.slots}:{args.hz}"
        os.environ.pop("FAKE_ENGINE_EVENTS", None)
        profile = Profile("bench")
        program = FAKE_ENGINE
    if args.refresh_s:
        from dataclasses import replace

        profile = replace(profile, tui=replace(profile.tui, refresh_s=args.refresh_s))
    ProfileStore(config_dir).save(profile)
    latencies_s: list[float] = []
    instrument(latencies_s)
    app = create_app(config_dir=config_dir, profile="bench", engine_program=program, engine_cwd=str(ROOT),
                     sampler_factory=None)
    async with app.run_test(size=(160, 48)) as pilot:
        deadline = time.monotonic() + 300
        while not app.view.telemetry_connected:
            if app.view.crash is not None or time.monotonic() > deadline:
                raise SystemExit(f"engine did not come up: {app.view.crash.error if app.view.crash else 'timeout'}")
            await pilot.pause(0.1)
        # Long generations (the context minus the 32-token prompt) keep every slot decoding through the window.
        max_tokens = profile.engine.context - 64
        load = (asyncio.create_task(send_load(app.view.engine_url, args.slots, max_tokens))
                if args.real_engine and not args.idle else None)
        deadline = time.monotonic() + 120
        while not args.idle and sum(1 for s in app.view.monitor.slots.values() if s.state == "decode") < args.slots:
            if time.monotonic() > deadline or (load is not None and load.done()):
                states = {n: s.state for n, s in app.view.monitor.slots.items()}
                raise SystemExit(f"the slots never all decoded: {states}; load: {load}")
            await pilot.pause(0.1)
        await pilot.pause(args.warmup_s)
        latencies_s.clear()
        events_before = app.view.monitor.last_seq
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(args.seconds)
        cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
        events = app.view.monitor.last_seq - events_before
        busy = sum(1 for s in app.view.monitor.slots.values() if s.state == "decode")
        if load is not None:
            load.cancel()
        await pilot.press("q")
    ordered = sorted(latencies_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000 if ordered else float("nan")

    return {
        "source": (f"real engine (CPU, --kv-pool {args.kv_pool}{', idle' if args.idle else ''})" if args.real_engine
                   else "fake engine, idle" if args.idle else f"fake engine {args.slots} slots x {args.hz} Hz"),
        "refresh_s": profile.tui.refresh_s,
        "busy_slots": busy,
        "window_s": round(wall_s, 2),
        "events_per_s": round(events / wall_s, 1),
        "tui_cpu_pct_of_one_core": round(100 * cpu_s / wall_s, 1),
        "events_timed": len(ordered),
        "latency_ms_p50": round(pct(0.50), 1),
        "latency_ms_p95": round(pct(0.95), 1),
        "latency_ms_max": round(ordered[-1] * 1000, 1) if ordered else None,
        "latency_ms_mean": round(statistics.fmean(ordered) * 1000, 1) if ordered else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=6)
    parser.add_argument("--hz", type=float, default=30.0, help="slot events per slot per second (fake engine)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measuring window")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--refresh-s", type=float, default=None, help="override the profile's refresh interval")
    parser.add_argument("--real-engine", action="store_true", help="launch the real strata-engine on CPU")
    parser.add_argument("--idle", action="store_true",
                        help="no load (the fake engine publishes nothing, the real one gets no request): the idle cost")
    parser.add_argument("--kv-pool", default="auto", choices=("auto", "by-use", "reserved"),
                        help="--real-engine: how its slots hold KV (by use, the app also reads the pool once a second)")
    parser.add_argument("--model", help="checkpoint for --real-engine (default: a random tiny one)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
