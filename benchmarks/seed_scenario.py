"""The seed report's killer scenario, N runs, against a real `strata-engine serve` subprocess.

Each run: a cold engine (`--batch 6 --batch-mtp`, STRATA_SPLIT_ATTN=1 plus the other switches, the adaptive
tier growing into the VRAM left after weights, KV and the reserve, so VRAM is near-full by design), 6
concurrent short generations, then 3 s later one fresh long prompt (>= 150K tokens on a GPU). It passes when
the engine never exits on its own, all 7 requests complete, and every out-of-memory the graph cache met is
reported with its real message (never empty, never "no error"), collected from /strata/events.

    python benchmarks/seed_scenario.py --runs 5 --device cuda:0 --model PATH            # the GPU benchmark
    python benchmarks/seed_scenario.py --runs 1 --device cpu --prompt-tokens 4000       # CPU smoke test
    python benchmarks/seed_scenario.py ... --fault-inject "instantiate:draft_round:1-40:oom"

--fault-inject forces the out-of-memory path (tests/fault_injection.py, installed in the engine process by
tests/fault_site/sitecustomize.py) where the real VRAM pressure does not happen to hit a capture. Writes a JSON report with --out; exits 0 only when every run passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from engine.loadgen.scenarios import run_scenario  # noqa: E402
from engine.switches import SWITCHES, get_switch  # noqa: E402
from engine.model.random_checkpoint import SIZES  # noqa: E402
from seed_process import EngineProcess, stop_engines_on_signals  # noqa: E402
from seed_vram import expert_books, expert_text, nvml_text, nvml_used, vram_books, vram_text  # noqa: E402

OOM_TEXT = re.compile(r"out of memory|cudaErrorMemoryAllocation|ALLOC_FAILED", re.IGNORECASE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="cold-engine runs (default 5)")
    p.add_argument("--model", default="builtin:strata-tiny")
    p.add_argument("--random-model", default=None, choices=tuple(SIZES),
                   help="write a random-weight checkpoint with an MTP head of this size and use it as --model "
                        "(moe-*: Qwen3-MoE; add --extra --expert-cache-mib auto for the seed's full-by-design "
                        "expert cache)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--no-batch-mtp", action="store_true", help="leave --batch-mtp off (it is on by default)")
    p.add_argument("--kv", default="int8", choices=("bf16", "int8"))
    p.add_argument("--vram-reserve-mib", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=150_000, help="tokens of the fresh long prompt")
    p.add_argument("--short-max-tokens", type=int, default=0,
                   help="tokens per short generation; 0 (default): decode until the long prompt is done, so the "
                        "shorts are still running when it is admitted, as in the seed report")
    p.add_argument("--delay-s", type=float, default=3.0)
    p.add_argument("--switches", default=",".join(s.name for s in SWITCHES),
                   help="switches to turn on (default: all; SPLIT_ATTN is the seed's)")
    p.add_argument("--fault-inject", default="", help="graph-capture faults for the engine process (tests/fault_injection.py rules)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=3600.0)
    p.add_argument("--in-process", action="store_true",
                   help="drive engine.orchestration.engine.Engine in this process instead of `serve` (while serve is not ready)")
    p.add_argument("--cpu-graphs", action="store_true",
                   help="in-process on CPU: route steps through GraphCache's CPU backend (exercises --fault-inject)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `serve` options, verbatim")
    return p.parse_args(argv)


def serve_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one cold engine."""
    context = args.prompt_tokens + 64 + 256  # the long prompt, its answer and a margin
    context = 1 << (context - 1).bit_length()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", args.model, "--device", args.device,
           "--batch", str(args.batch), "--kv", args.kv, "--context", str(context), "--port", "0"]
    if not args.no_batch_mtp:
        cmd.append("--batch-mtp")
    if args.vram_reserve_mib is not None:
        cmd += ["--vram-reserve-mib", str(args.vram_reserve_mib)]
    cmd += list(args.extra)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in filter(None, (n.strip() for n in args.switches.split(","))):
        env[get_switch(name).env_var] = "1"
    if args.fault_inject:
        from tests.fault_injection import engine_process_env

        env = engine_process_env(args.fault_inject, env)
    return cmd, env


async def collect_events(base_url: str, sink: list[dict], stop: asyncio.Event) -> None:
    """Append every telemetry event from /strata/events to `sink` until `stop` is set."""
    async with httpx.AsyncClient(timeout=None) as client:
        try:
            async with client.stream("GET", f"{base_url}/strata/events") as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        sink.append(json.loads(line[5:]))
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            return  # the engine went away: what was collected stands


def judge_events(events: list[dict]) -> dict[str, Any]:
    """Graph and expert-cache actions counted, every OOM's text, and whether any reported error is empty or says 'no error'."""
    actions: dict[str, int] = {}
    expert_actions: dict[str, int] = {}
    ooms, bad, errors, warnings = [], [], [], []
    for ev in events:
        if ev.get("type") == "graph":
            actions[ev["action"]] = actions.get(ev["action"], 0) + 1
        elif ev.get("type") == "expert":
            expert_actions[ev["action"]] = expert_actions.get(ev["action"], 0) + 1
        text = ev.get("error") if ev.get("type") == "graph" else ev.get("message")
        if ev.get("type") in ("graph", "error", "warning") and text is not None:
            if not text.strip() or "no error" in text.lower():
                bad.append(ev)
            if OOM_TEXT.search(text):
                ooms.append(text)
        if ev.get("type") == "error":
            errors.append(ev)
        elif ev.get("type") == "warning":
            warnings.append(ev.get("message", ""))
    return {"graph_actions": actions, "expert_actions": expert_actions, "oom_messages": ooms, "bad_messages": bad, "error_events": errors,
            "warnings": warnings}


async def one_run(args: argparse.Namespace, index: int) -> dict[str, Any]:
    cmd, env = serve_command(args)
    engine = EngineProcess(cmd, env)
    events: list[dict] = []
    record: dict[str, Any] = {"run": index, "command": cmd}
    try:
        started_s = time.monotonic()
        url = engine.wait_ready(args.ready_timeout_s)
        record["ready_s"] = round(time.monotonic() - started_s, 2)
        record["vram_at_ready"] = await vram_books(url)
        record["nvml_at_ready"] = nvml_used()
        record["experts_at_ready"] = await expert_books(url)
        # Printed at once: a run cut short by an outer time limit still says how far it got.
        print(f"run {index}: engine ready in {record['ready_s']} s at {url}; {vram_text(record['vram_at_ready'])}; "
              f"{nvml_text(record['nvml_at_ready'])}; {expert_text(record['experts_at_ready'])}", flush=True)
        stop = asyncio.Event()
        collector = asyncio.create_task(collect_events(url, events, stop))
        result = await asyncio.wait_for(run_scenario(
            "seed", url, concurrency=6, delay_s=args.delay_s, long_tokens=args.prompt_tokens,
            short_max_tokens=args.short_max_tokens), args.run_timeout_s)
        exited_during = engine.proc.poll()
        record["vram_after"] = await vram_books(url)
        record["nvml_after"] = nvml_used()
        record["experts_after"] = await expert_books(url)
        await asyncio.sleep(0.5)  # let the last events arrive
        stop.set()
        collector.cancel()
        record.update(completed=sum(1 for r in result.requests if r.error is None and r.end_s is not None),
                      requests=len(result.requests), request_errors=result.errors, health_after=result.health_after,
                      metrics=result.metrics, notes=list(result.notes), wall_s=round(result.wall_s, 2),
                      exited_during_run=exited_during)
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the next one still runs
        record.update(failure=f"{type(exc).__name__}: {exc}", completed=0, requests=0, exited_during_run=engine.proc.poll())
    finally:
        record["exit_code_after_sigterm"] = engine.stop()
        record["stderr_tail"] = engine.stderr_tail[-20:]
    record.update(judge_events(events))
    record["events"] = len(events)
    # A server that does not exit 0 on SIGTERM is a defect a person sees ("Aborted (core dumped)" in the terminal,
    # exit status -6).
    record["passed"] = (record.get("exited_during_run") is None and record.get("requests") == 7
                        and record.get("completed") == 7 and not record["bad_messages"]
                        and not any(e.get("fatal") for e in record["error_events"])
                        and record["exit_code_after_sigterm"] == 0)
    return record


def in_process_run(args: argparse.Namespace, index: int) -> dict[str, Any]:
    """The same scenario against engine.orchestration.engine.Engine stepped in a thread of this process."""
    import random

    from engine.api import SamplingParams
    from engine.config import config_from_args
    from engine.cli.serve import add_arguments
    from engine.orchestration.engine import Engine
    from engine.telemetry import EventBus

    cmd, env = serve_command(args)
    os.environ.update({k: v for k, v in env.items() if k.startswith("STRATA_")})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(cmd[cmd.index("serve") + 1:]))
    bus, holder = EventBus(history=100_000), {}
    executor = _graph_cache(args, config, bus, holder)
    engine = Engine(config, bus, graphs=executor)
    holder["engine"] = engine
    if executor is not None:
        executor.board = executor.compiler.board = engine.board
    executor = engine.graphs
    vocab = engine.lm.config.vocab_size
    rng = random.Random(index)
    done: dict[str, Any] = {}
    start = time.monotonic()

    def add(rid: str, n_tokens: int, max_tokens: int) -> None:
        prompt = [rng.randrange(16, vocab - 16) for _ in range(n_tokens)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    until_long_done = args.short_max_tokens == 0  # as the HTTP scenario: decode until the long one is done
    short_max = config.context - 64 if until_long_done else args.short_max_tokens
    for i in range(6):
        add(f"short-{i}", 64, short_max)
    long_sent = False
    record: dict[str, Any] = {"run": index, "command": cmd, "in_process": True}
    try:
        while len(done) < 7 and time.monotonic() - start < args.run_timeout_s:
            if not long_sent and time.monotonic() - start >= args.delay_s:
                if until_long_done and config.batch <= 6:
                    _stop(engine, done, [f"short-{i}" for i in range(6 - config.batch + 1)])  # frees its slot
                add("long", args.prompt_tokens, 16)
                long_sent = True
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if until_long_done and "long" in done:
                _stop(engine, done, [f"short-{i}" for i in range(6)])
            if not engine.health().ready:
                break
    except Exception as exc:  # noqa: BLE001 - reported as the run's failure
        record["failure"] = f"{type(exc).__name__}: {exc}"
    ok = [o for o in done.values() if o.finish_reason in ("length", "stop", "abort")]
    health = engine.health()
    record.update(completed=len(ok), requests=7, request_errors=[o.error for o in done.values() if o.error],
                  health_after=("200 " if health.ready else "503 ") + health.reason,
                  exited_during_run=None if health.ready else 1, exit_code_after_sigterm=None,
                  wall_s=round(time.monotonic() - start, 2))
    events = [e.to_json() for e in bus.history()]
    record.update(judge_events(events), events=len(events))
    record["graphs"] = executor.snapshot().to_json() if hasattr(executor, "snapshot") else None
    record["passed"] = (health.ready and len(ok) == 7 and not record["bad_messages"]
                        and not any(e.get("fatal") for e in record["error_events"]))
    return record


def _stop(engine: Any, done: dict[str, Any], request_ids: list[str]) -> None:
    """Abort the given requests that are still running; each counts as completed (stopped by the scenario)."""
    for rid in request_ids:
        if rid not in done:
            out = engine.abort(rid)
            if out is not None:
                done[rid] = out


def _graph_cache(args: argparse.Namespace, config: Any, bus: Any, holder: dict) -> Any:
    """--cpu-graphs: a GraphCache on the CPU backend (on CUDA the engine builds its own GraphCache)."""
    from engine.exec.graphs.backends import CpuGraphBackend
    from engine.exec.graphs.cache import GraphCache
    from engine.exec.runner import switch_for_key
    from engine.switches import SwitchBoard

    if not (args.cpu_graphs and config.graphs) or config.device.startswith("cuda") or (
            config.device == "auto" and _cuda_available()):
        return None

    def release_tier(mib: float, reason: str) -> float:
        engine = holder.get("engine")
        return engine.tier.release(mib, reason) if engine is not None else 0.0

    # in_process_run points the cache at the engine's own SwitchBoard once the engine exists.
    return GraphCache("cpu", bus, SwitchBoard.from_values(config.switches), release_tier, config.tier_wait_polls,
                      config.tier_wait_interval_s, switch_for_key=switch_for_key, backend=CpuGraphBackend())


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def print_run(r: dict[str, Any]) -> None:
    verdict = "PASS" if r["passed"] else "FAIL"
    print(f"run {r['run']}: {verdict}  completed {r.get('completed')}/{r.get('requests')}  "
          f"engine exited during run: {r.get('exited_during_run') is not None}  "
          f"exit after SIGTERM: {r.get('exit_code_after_sigterm')}  wall {r.get('wall_s', '-')} s", flush=True)
    print(f"  graph events: {r['graph_actions'] or 'none'}; OOMs reported: {len(r['oom_messages'])}; "
          f"empty/'no error' messages: {len(r['bad_messages'])}")
    metrics = r.get("metrics") or {}
    if metrics.get("long_ttft_s") is not None:
        ratio = metrics.get("decode_ratio")
        print(f"  long prompt TTFT {metrics['long_ttft_s']:.2f} s; short decode ratio during its prefill "
              f"{'-' if ratio is None else f'{ratio:.3f}'}")
    elif "metrics" in r:  # said, not left out: a run that passes without its measurement must not look measured
        print("  long prompt TTFT: not measured (the client saw no token of it before it ended)")
    if "vram_after" in r:
        print(f"  after: {vram_text(r['vram_after'])}; {nvml_text(r.get('nvml_after', ''))}")
    if r.get("experts_after") is not None:
        print(f"  after: {expert_text(r['experts_after'])}; expert events: {r.get('expert_actions') or 'none'}")
    for text in r["oom_messages"][:5]:
        print(f"    OOM: {text}")
    for w in r["warnings"][:5]:
        print(f"    WARNING: {w}")
    if r.get("failure"):
        print(f"  failure: {r['failure']}")
    if r.get("failure") or r.get("exit_code_after_sigterm") not in (0, None):
        print("  " + "\n  ".join(r.get("stderr_tail", [])))


async def main_async(args: argparse.Namespace) -> int:
    if args.random_model:
        import tempfile

        from engine.model.random_checkpoint import write_random_checkpoint

        path = Path(tempfile.mkdtemp(prefix="strata-seed-")) / args.random_model
        args.model = str(write_random_checkpoint(path, mtp_layout="deepseek", size=args.random_model,
                                                 dtype="bfloat16"))
    records = []
    for i in range(1, args.runs + 1):
        record = in_process_run(args, i) if args.in_process else await one_run(args, i)
        print_run(record)
        records.append(record)
    passed = sum(r["passed"] for r in records)
    exits = sum(r.get("exited_during_run") is not None for r in records)
    print(f"seed scenario: {passed}/{len(records)} runs passed, {exits} engine exits, "
          f"{sum(len(r['oom_messages']) for r in records)} OOMs reported with their real message")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": records},
                                       indent=2, default=str))
    return 0 if passed == len(records) else 1


def main(argv: list[str] | None = None) -> int:
    stop_engines_on_signals()
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
