"""How true is the TUI's prefill ETA? Measured against a real engine on one fresh long prompt.

Starts `strata-engine serve` (the embedded builtin:strata-tiny unless --model says otherwise), follows its
`/strata/events` with the TUI's own client and MonitorState, and sends one fresh prompt of random token ids
(nothing cached) with max_tokens=1. Every `--refresh-s` (the TUI's redraw interval) it reads the ETA the
slot row would show. At the halfway mark (the first refresh at which half of the prompt has KV) it notes
that ETA, and the engine's own `eta_s` from its latest slot event; when the first token arrives it compares
both with the time that was really left. It also reports the longest stretch during which the shown ETA did
not change, how many chunks had run when the first ETA showed, and the largest jump of the shown ETA between
two refreshes (against what counting down alone would show; the goal is under 2x). `--decode-slots N` keeps N other requests
decoding beside the long prompt (the prompt is then paced: its chunks share the steps with them).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_prefill_eta.py --prompt-tokens 12288 32768 --context 33792 \
        --chunk-tokens 1024 --decode-slots 0 2
    python3 benchmarks/bench_prefill_eta.py --device cuda:0 --prompt-tokens 12288 32768 180000 --context 184320 \
        --decode-slots 0 4   # a GPU
    .venv/bin/python benchmarks/bench_prefill_eta.py --replay results.jsonl   # the model on recorded curves
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from engine.prefill_cost import fit_chunks, span_cost_s  # noqa: E402
from strata_tui.engine_io.launcher import READY_RE  # noqa: E402
from strata_tui.engine_io.telemetry_client import TelemetryClient  # noqa: E402
from strata_tui.state.monitor_state import MonitorState  # noqa: E402
from strata_tui.widgets.slot_cells import format_eta  # noqa: E402


async def start_engine(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    argv = [sys.executable, "-m", "engine.cli", "serve", "--model", args.model, "--device", args.device,
            "--batch", str(args.decode_slots + 1), "--context", str(args.context), "--port", "0",
            "--prefill-chunk-tokens", str(args.chunk_tokens), "--step-token-budget", str(args.chunk_tokens * 2)]
    # The checkout first, whatever else the caller's path holds (a machine without a package index carries its
    # server wheels on PYTHONPATH).
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT)
    said: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 600)).decode(errors="replace")
        if not line:
            last = "".join(said[-5:]).rstrip()
            raise SystemExit(f"the engine exited before it was ready: {' '.join(argv)}\n{last}")
        said.append(line)
        match = READY_RE.match(line.strip())
        if match:
            asyncio.create_task(_drain(proc.stdout))
            return proc, match.group(1)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


async def measure(args: argparse.Namespace) -> dict:
    proc, url = await start_engine(args)
    state = MonitorState.for_profile({}, 0)
    client = TelemetryClient(url)
    ends: dict[str, float] = {}  # request id -> engine stamp of its first slot event past prefill
    follow = asyncio.create_task(_follow(client, state, ends))
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, args.vocab) for _ in range(args.prompt_tokens)]
    decoders: list[asyncio.Task] = []
    try:
        await asyncio.sleep(1.0)  # the event stream is connected before the prompt goes in
        async with httpx.AsyncClient(base_url=url, timeout=None) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            decoders = [asyncio.create_task(_decode(http, model, rng, args)) for _ in range(args.decode_slots)]
            while sum(1 for s in state.slots.values() if s.state == "decode") < args.decode_slots:
                await asyncio.sleep(0.05)
            sent_s = time.monotonic()
            request = asyncio.create_task(http.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}))
            half = first_eta = None
            last_track = None
            shown: list[tuple[float, str]] = []
            etas: list[tuple[float, float, float]] = []  # (local time, ETA shown, progress) at every refresh
            while not request.done():
                await asyncio.sleep(args.refresh_s)
                now_s = time.monotonic()
                slot = next((s for s in state.slots.values() if s.state == "prefill" and s.request_id), None)
                track = state.track_of(slot) if slot is not None else None
                if track is None:
                    continue
                eta = track.eta_s(now_s)
                shown.append((now_s, format_eta(eta)))
                if eta is not None:
                    etas.append((now_s, eta, track.progress))
                last_track = track
                if first_eta is None and eta is not None:
                    first_eta = {"chunks_run": max(0, len(track.samples) - 1), "progress": round(track.progress, 3)}
                if half is None and track.progress >= 0.5 and eta is not None:
                    half = {"at_s": now_s, "progress": track.progress, "tui_eta_s": eta,
                            "engine_eta_s": slot.eta_s, "computed_tokens": track.computed_tokens}
            response = await request
            done_s = time.monotonic()
            response.raise_for_status()
            waited_s = done_s + 2.0  # the first token's event may come a moment after the response
            while last_track is not None and last_track.request_id not in ends and time.monotonic() < waited_s:
                await asyncio.sleep(0.02)
    finally:
        for task in decoders:
            task.cancel()
        follow.cancel()
        await client.aclose()
        proc.terminate()
        await proc.wait()
    if half is None:
        raise SystemExit("never saw the halfway mark: make the prompt longer")
    truth_s = done_s - half["at_s"]
    return {
        "prompt_tokens": args.prompt_tokens, "decode_slots": args.decode_slots, "device": args.device,
        "model": args.model, "first_eta_after": first_eta,
        "chunk_tokens": args.chunk_tokens, "prefill_wall_s": round(done_s - sent_s, 2),
        "halfway_progress": round(half["progress"], 3), "true_remaining_s": round(truth_s, 2),
        "tui_eta_s": round(half["tui_eta_s"], 2),
        "tui_error_pct": round(100 * (half["tui_eta_s"] - truth_s) / truth_s, 1),
        "engine_eta_s": None if half["engine_eta_s"] is None else round(half["engine_eta_s"], 2),
        "engine_error_pct": None if half["engine_eta_s"] is None
        else round(100 * (half["engine_eta_s"] - truth_s) / truth_s, 1),
        "longest_unchanged_eta_s": round(_longest_unchanged(shown), 2),
        "largest_jump": _largest_jump(etas),
        # (tokens with KV, engine seconds since admission) after each chunk: the cost curve, for replaying
        "chunks": [[x, round(t - last_track.admitted_ts, 3)] for t, x, _ in last_track.samples]
        if last_track is not None and last_track.admitted_ts else [],
        # the first token's engine stamp on the same clock: the last chunk's end, so a replay knows the whole curve
        "first_token_s": round(ends[last_track.request_id] - last_track.admitted_ts, 3)
        if last_track is not None and last_track.admitted_ts and last_track.request_id in ends else None,
    }


async def _decode(http: httpx.AsyncClient, model: str, rng: random.Random, args: argparse.Namespace) -> None:
    """One request decoding beside the long prompt until the run ends (cancelled then)."""
    prompt = [rng.randrange(1, args.vocab) for _ in range(32)]
    async with http.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": args.context - 64, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        async for _ in response.aiter_bytes():
            pass


async def _follow(client: TelemetryClient, state: MonitorState, ends: dict[str, float]) -> None:
    async for batch in client.events():
        state.apply_all(batch)
        for event in batch:  # max_tokens=1: the slot goes from prefill to finished (no decode event)
            if event.type == "slot" and event.request_id and event.state in ("decode", "finished"):
                ends.setdefault(event.request_id, event.ts)


def _largest_jump(etas: list[tuple[float, float, float]], floor_s: float = 1.0) -> dict | None:
    """The largest change of the shown ETA between two refreshes, as a ratio, against what counting down alone
    would show (the earlier ETA less the time between): 1.0 is a clock that only counts down. ETAs under
    `floor_s` are taken as `floor_s` (the last second's countdown is no jump)."""
    worst = None
    for (t0, e0, p0), (t1, e1, p1) in zip(etas, etas[1:]):
        expected = max(floor_s, e0 - (t1 - t0))
        shown = max(floor_s, e1)
        ratio = max(expected, shown) / min(expected, shown)
        if worst is None or ratio > worst["ratio"]:
            worst = {"ratio": round(ratio, 2), "from_eta_s": round(e0, 1), "to_eta_s": round(e1, 1),
                     "at_progress": round(p1, 3)}
    return worst


def _longest_unchanged(shown: list[tuple[float, str]]) -> float:
    longest, start_s, last = 0.0, None, None
    for at_s, text in shown:
        if text != last:
            start_s, last = at_s, text
        longest = max(longest, at_s - start_s)
    return longest


def replay(path: Path) -> list[dict]:
    """The halfway ETA the current cost model (engine/prefill_cost.py) gives on each recorded run's chunk curve
    (a JSON line of this benchmark, its `chunks`; other lines are skipped), against the time that was really left
    then: a change of the model is judged on curves recorded on a GPU without one."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("{"):  # a step's log holds other lines too (benchmarks/run_all_gpu.sh)
            continue
        run = json.loads(line)
        total, points = run["prompt_tokens"], [(int(x), float(t)) for x, t in run.get("chunks", [])]
        half = next((k for k, (x, _) in enumerate(points) if x >= total / 2), None)
        if half is None:
            continue
        model = fit_chunks([(x0, x1, t1 - t0) for (x0, t0), (x1, t1) in zip(points[:half], points[1:half + 1])])
        eta_s = span_cost_s(*model, points[half][0], total) if model else None
        truth_s = run["true_remaining_s"]
        out.append({"prompt_tokens": total, "decode_slots": run["decode_slots"], "device": run["device"],
                    "true_remaining_s": truth_s, "recorded_tui_error_pct": run["tui_error_pct"],
                    "replayed_eta_s": None if eta_s is None else round(eta_s, 2),
                    "replayed_error_pct": None if eta_s is None else round(100 * (eta_s - truth_s) / truth_s, 1)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", type=Path, metavar="JSONL",
                        help="no engine: the current model's halfway ETA on the chunk curves of earlier runs")
    parser.add_argument("--model", default="builtin:strata-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[65536], help="one run per size")
    parser.add_argument("--decode-slots", type=int, nargs="+", default=[0],
                        help="requests decoding beside the long prompt: one run per count")
    parser.add_argument("--context", type=int, default=0, help="default: the largest prompt + 1024")
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192, help="token ids are drawn from 1..vocab-1")
    parser.add_argument("--refresh-s", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    if args.replay is not None:
        if not args.replay.is_file():
            parser.error(f"--replay {args.replay}: no such file")
        for result in replay(args.replay):
            print(json.dumps(result), flush=True)
        return 0
    sizes, slot_counts = args.prompt_tokens, args.decode_slots
    args.context = args.context or max(sizes) + 1024
    if max(sizes) + 64 > args.context:
        parser.error(f"--context {args.context} is too small for --prompt-tokens {max(sizes)} (+64)")
    for size in sizes:
        for slots in slot_counts:
            for run in range(args.runs):
                args.prompt_tokens, args.decode_slots, args.seed = size, slots, args.seed + run
                print(json.dumps(asyncio.run(measure(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
