"""`strata-engine bench throughput`: N concurrent requests through the real Engine, against the floor and an HF peer.

For each request set and each concurrency N (`--concurrency`, default 1,8,32,64,128,256), N requests arrive at
once on an engine of N slots (KV by use, the default: N slots of the whole context would not fit at N = 256,
`--kv-pool reserved` measures them reserved) and it steps until all finish. Sets (`--sets`):

- `fixed`: every prompt `--prompt-tokens` (1K) tokens, every output `--new-tokens` (256);
- `mixed`: seeded (`--seed`) prompts uniform in `--mixed-prompt-tokens` (128-8K) and outputs in
  `--mixed-new-tokens` (64-1K).

Before each row's timed burst the engine serves a warm-up (`--warm-up`): by default the same N prompts with other
tokens, until the whole batch has decoded together for a few steps (then aborted), so what a burst of that shape
does once (Triton kernels compiled for its shapes, a graph captured per batch bucket and chunk size, the KV pool's
first sizing) is done when the clock starts, as on a server that has served before; `--warm-up short` (two
requests of 8 tokens) times a fresh engine's first burst.

`--chunk-rows off` runs every prompt chunk as its own forward (the engine's default, `on`, runs the chunks of one
length bucket in a step as rows of one forward: engine.exec.chunk_rows), to measure what that is worth.

Per row: output tok/s (all output tokens / wall time), decode tok/s (output tokens after every request had its first
token / the time after that), TTFT p50/p99 (arrival to first token), inter-token p50/p99 (the time between a
request's outputs divided by the tokens each brought: MTP may bring several), engine steps, preemptions (KV spilled
to host to make room).

The floor: a decode step reads the weights once and every live token's KV once, at the device's measured copy
bandwidth (bytes read + written per second, as `bench peers` measures it), so N decoding requests of mean live
length L make at most N / ((weights + N * L * kv_bytes_per_token) / bandwidth) tokens a second. L is the mean of
prompt + half the output over the set. The HF peer (`--peer static`: transformers' static cache with
torch.compile on CUDA; `eager`; `none`) runs the fixed set's batched `generate` in a subprocess bounded by
`--peer-timeout-s`, at the concurrencies up to `--peer-max-concurrency` (8): a peer that does not finish, or runs out of memory, is a row with its error. The peer reads
its prompts from a temporary file and reports each phase it starts (imports, checkpoint load, each warm-up call:
the first compiles and captures graphs on CUDA, the timed call): its row's `peer_phases_s` gives each phase's
seconds, and a peer killed for time names the phase it was in.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.bench.common import device_of, emit, prepare_model, random_prompt, save_partial, weight_bytes
from engine.bench.step_trace import StepTrace
from engine.errors import ConfigError

DEFAULT_CONCURRENCY = (1, 8, 32, 64, 128, 256)
SETS = ("fixed", "mixed")
PEERS = ("static", "eager", "none")


def request_set(name: str, n: int, vocab: int, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt, max new tokens) of the n requests of set `name`; the mixed set is seeded by `--seed` and n."""
    if name == "fixed":
        return [(random_prompt(args.prompt_tokens, vocab, seed=10_000 + i), args.new_tokens) for i in range(n)]
    rng = random.Random(args.seed * 1_000_003 + n)
    lo_p, hi_p = args.mixed_prompt_tokens
    lo_n, hi_n = args.mixed_new_tokens
    return [(random_prompt(rng.randint(lo_p, hi_p), vocab, seed=20_000 + i), rng.randint(lo_n, hi_n))
            for i in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


WARM_UP_SETTLE_STEPS = 4  # steps a warm-up burst runs once every request has its first token


def drive(engine: Any, requests: list[tuple[list[int], int]], trace: Any = None,
          settle_steps: int | None = None) -> dict[str, Any]:
    """Add every request at once, step until all finish; the latencies and rates of one row. `trace`
    (engine.bench.step_trace.StepTrace) hears about every step. `settle_steps` (a warm-up): stop that many steps
    after every request has its first token, aborting the rest: the whole batch has then decoded together, however
    many steps its admission took (a fixed count of output tokens each left a burst's first requests finished before
    its last were admitted: the timed burst then compiled and captured the full batch's decode step)."""
    from engine.api import SamplingParams

    start = time.perf_counter()
    ids = []
    for i, (prompt, new) in enumerate(requests):
        rid = f"t{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        ids.append(rid)
    first_s: dict[str, float] = {}
    last_s: dict[str, float] = {}
    gaps: list[float] = []
    tokens = 0
    steps = 0
    all_first_s = None
    tokens_at_all_first = settled_at = 0
    limit = sum(len(p) + n for p, n in requests) + 100  # every step computes a token of some request
    while engine.has_work:
        if trace is not None:
            trace.before_step()
        step_s = time.perf_counter()
        outs = engine.step()
        steps += 1
        if steps > limit:
            raise RuntimeError(f"no progress: {steps} steps for {len(requests)} requests")
        now = time.perf_counter()
        if trace is not None:
            trace.after_step(step_s - start, now - step_s, len(outs))
        for out in outs:
            n = len(out.token_ids)
            if out.finish_reason in ("error", "abort"):
                raise RuntimeError(f"request {out.request_id} ended with {out.finish_reason}: {out.error}")
            if not n:
                continue
            tokens += n
            if out.request_id not in first_s:
                first_s[out.request_id] = now - start
                if n > 1:
                    gaps += [0.0] * (n - 1)
            else:
                gaps += [(now - start - last_s[out.request_id]) / n] * n
            last_s[out.request_id] = now - start
        if all_first_s is None and len(first_s) == len(ids):
            all_first_s, tokens_at_all_first, settled_at = now - start, tokens, steps
        if settle_steps is not None and all_first_s is not None and steps - settled_at >= settle_steps:
            for rid in ids:
                engine.abort(rid)  # those still running; a finished one is no longer active
            break
    wall_s = time.perf_counter() - start
    ttft = [first_s[r] for r in ids]
    decode_s = wall_s - (all_first_s or wall_s)
    return {"tok_s": tokens / wall_s, "wall_s": wall_s, "output_tokens": tokens,
            "decode_tok_s": (tokens - tokens_at_all_first) / decode_s if decode_s > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "all_first_token_s": max(ttft),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "steps": steps}


def floor_tok_s(weights_bytes: int, kv_bytes_per_token: int, n: int, mean_live_tokens: float,
                bandwidth_gb_s: float) -> float:
    """Decode tok/s of n rows if a step only read the weights once and every live token's KV once."""
    step_bytes = weights_bytes + n * mean_live_tokens * kv_bytes_per_token
    return n * bandwidth_gb_s * 1e9 / step_bytes


# The peer reads its request from a file (64 prompts of 1K tokens are past Linux's 128 KiB limit on one argv
# string) and appends each phase it starts, with its time since launch, to another, so a peer that is killed
# for time is a row that says where it was.
_PEER_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
progress = open(sys.argv[2], "a", buffering=1)
def phase(name):
    progress.write(json.dumps([name, time.perf_counter() - t0]) + "\\n")
phase("importing torch and transformers")
import torch
from engine.bench.peers import hf_generate_tok_s
with open(sys.argv[1]) as f:
    a = json.load(f)
r = hf_generate_tok_s(a["path"], torch.device(a["device"]), getattr(torch, a["dtype"]), a["prompts"],
                      a["new_tokens"], a["static"], a["compile"], 1, phase)
phase("done")
print(json.dumps(r))
"""


def _phases(progress: Path) -> list[tuple[str, float]]:
    """The (phase, seconds since launch) the peer reported, in order; an unfinished last line is skipped."""
    phases = []
    for line in progress.read_text().splitlines() if progress.is_file() else []:
        try:
            name, at_s = json.loads(line)
        except ValueError:
            continue
        phases.append((str(name), float(at_s)))
    return phases


def _phase_times(phases: list[tuple[str, float]], end_s: float) -> dict[str, float]:
    """Seconds each phase took (the last one until `end_s`)."""
    ends = [at for _, at in phases[1:]] + [end_s]
    return {name: round(stop - at, 3) for (name, at), stop in zip(phases, ends) if name != "done"}


def peer_row(args: argparse.Namespace, path: str, device: Any, prompts: list[list[int]], new_tokens: int) -> dict:
    """The HF peer's batched generate of `prompts`, in a subprocess killed after `--peer-timeout-s`; its row
    says where the time went (`peer_phases_s`) and, if killed, which phase it was in."""
    static = args.peer == "static"
    compile_ = static and device.type == "cuda"
    name = "hf_static_compile" if compile_ else f"hf_{args.peer}"
    with tempfile.TemporaryDirectory(prefix="strata-peer-") as scratch:
        request, progress = Path(scratch) / "request.json", Path(scratch) / "progress.jsonl"
        request.write_text(json.dumps({"path": path, "device": str(device), "dtype": args.peer_dtype,
                                       "prompts": prompts, "new_tokens": new_tokens, "static": static,
                                       "compile": compile_}))
        t0 = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, "-c", _PEER_SCRIPT, str(request), str(progress)],
                                 capture_output=True, text=True, timeout=args.peer_timeout_s)
        except subprocess.TimeoutExpired:
            total_s = time.perf_counter() - t0
            phases = _phases(progress)
            where = (f"stopped in {phases[-1][0]} after {total_s - phases[-1][1]:.1f} s of it" if phases
                     else "stopped before Python started")
            return {"engine": name, "tok_s": None, "wall_s": None, "peer_phases_s": _phase_times(phases, total_s),
                    "error": f"did not finish within --peer-timeout-s {args.peer_timeout_s:g} s (warm-up "
                             f"included): {where}"}
        total_s = time.perf_counter() - t0
        phases = _phases(progress)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"engine": name, "tok_s": None, "wall_s": None, "peer_phases_s": _phase_times(phases, total_s),
                "error": f"exit {out.returncode}: {tail[:200]}"}
    result = json.loads(lines[-1])
    return {"engine": name, "tok_s": result.get("tok_s"), "wall_s": result.get("wall_s"),
            "error": result.get("error"), "peer_total_s": total_s, "peer_phases_s": _phase_times(phases, total_s)}


def run(args: argparse.Namespace) -> int:
    from engine.bench.engine_driver import build_engine
    from engine.bench.peers import copy_bandwidth_gb_s
    from engine.model import ModelConfig
    from engine.model.loader import resolve_model_path

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown or not sets:
        raise ConfigError("sets", args.sets, f"expected a list of {', '.join(SETS)}")
    for name in ("mixed_prompt_tokens", "mixed_new_tokens"):
        lo_hi = getattr(args, name)
        if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
            raise ConfigError(name, lo_hi, "expected MIN,MAX")
    device = device_of(args.device)
    path = prepare_model(args.model, device, args.dtype)
    mcfg = ModelConfig.from_file(resolve_model_path(path) / "config.json")
    w_bytes = weight_bytes(path)
    bw_gb_s = copy_bandwidth_gb_s(device, args.copy_mib)
    rows: list[dict[str, Any]] = []
    fatal: Exception | None = None  # a sticky device fault: no later row can run
    for set_name in sets:
        for n in args.concurrency:
            if fatal is not None:
                break
            requests = request_set(set_name, n, mcfg.vocab_size, args)
            longest = max(len(p) + new for p, new in requests)
            mean_live = statistics.fmean(len(p) + new / 2 for p, new in requests)
            bench = build_engine(args, model=path, batch=n, queue_max=max(n, 1), context=longest + 64)
            if args.chunk_rows == "off":  # the A/B of engine.exec.chunk_rows: every chunk its own forward
                bench.engine.executor.rows_max_tokens = 0
            try:
                kv = bench.engine.kv
                kv_bytes = kv.geometry.bytes_per_token(kv.storage, kv.compute_dtype)
                warm = [(random_prompt(len(p), mcfg.vocab_size, seed=90_000 + i), new)
                        for i, (p, new) in enumerate(request_set(set_name, n, mcfg.vocab_size, args))]
                if args.warm_up == "short":
                    drive(bench.engine, [(p, min(new, 8)) for p, new in warm[:2]])
                else:
                    drive(bench.engine, warm, settle_steps=WARM_UP_SETTLE_STEPS)
                paging = bench.engine.kv.paging
                preempted_before = paging.stats.preemptions if paging is not None else 0  # the warm-up's
                watch = bench.bus.subscribe(after_seq=None, max_queue=1 << 20)
                trace = StepTrace(watch.drain, args.slow_steps, args.slow_steps_profile)
                try:
                    timed = drive(bench.engine, requests, trace)
                finally:
                    trace.finish()  # also when the burst failed: Triton's compile hook is given back
                    watch.close()
                row: dict[str, Any] = {"set": set_name, "engine": "strata", "concurrency": n,
                                       "chunk_rows": args.chunk_rows, "warm_up": args.warm_up, **timed,
                                       **one_time_work(trace.events), "error": None}
                if args.slow_steps:
                    row["slow_steps"] = trace.slowest()
                row["preemptions"] = paging.stats.preemptions - preempted_before if paging is not None else 0
                row["step_token_budget"] = bench.engine.sched.step_token_budget  # the rule's, unless given
            except Exception as exc:  # noqa: BLE001 - one row that cannot run (out of memory) is a result
                row = {"set": set_name, "engine": "strata", "concurrency": n, "tok_s": None,
                       "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                kv_bytes = 0
            finally:
                try:
                    bench.close()
                except Exception as exc:  # noqa: BLE001 - a device fault surfacing at close ends the run, not the rows
                    row["error"] = row.get("error") or f"at close: {type(exc).__name__}: {str(exc)[:200]}"
                    fatal = exc
            floor = floor_tok_s(w_bytes, kv_bytes, n, mean_live, bw_gb_s) if kv_bytes else None
            row["floor_tok_s"] = floor
            if floor and row.get("decode_tok_s"):
                row["decode_fraction_of_floor"] = row["decode_tok_s"] / floor
            rows.append(row)
            save_partial(args, "throughput", rows, device)
            if fatal is not None:
                break
            if set_name == "fixed" and args.peer != "none" and n <= args.peer_max_concurrency:
                peer = peer_row(args, path, device, [p for p, _ in requests], args.new_tokens)
                rows.append({"set": set_name, "concurrency": n, **peer})
                save_partial(args, "throughput", rows, device)
    summary = _summary(rows, bw_gb_s, w_bytes)
    emit(args, "throughput", rows, summary, device,
         ("set", "engine", "concurrency", "tok_s", "decode_tok_s", "floor_tok_s", "ttft_p50_s", "ttft_p99_s",
          "all_first_token_s", "itl_p50_s", "itl_p99_s", "steps", "preemptions", "graph_captures", "pool_growths",
          "step_token_budget", "error"))
    for row in rows:
        if row.get("slow_steps"):
            print("\n".join(StepTrace.lines(row["concurrency"], row["slow_steps"])))
    return 1 if fatal is not None else 0


def one_time_work(events: list[Any]) -> dict[str, int]:
    """What the timed burst spent on work a serving engine does once per shape: graphs captured and KV pool
    growths (each of which also drops every captured graph)."""
    actions = [(e.type, getattr(e, "action", "")) for e in events]
    return {"graph_captures": actions.count(("graph", "capture")), "pool_growths": actions.count(("kv", "grow"))}


def _summary(rows: list[dict[str, Any]], bw_gb_s: float, w_bytes: int) -> dict[str, Any]:
    summary: dict[str, Any] = {"copy_bandwidth_gb_s": bw_gb_s, "weight_mib": w_bytes / 2**20}
    strata = {(r["set"], r["concurrency"]): r for r in rows if r["engine"] == "strata" and r.get("tok_s")}
    peers = [r for r in rows if r["engine"].startswith("hf_") and r.get("tok_s")]
    best_peer = max(peers, key=lambda r: r["tok_s"], default=None)
    if best_peer is not None:
        summary["peer_best"] = {"engine": best_peer["engine"], "concurrency": best_peer["concurrency"],
                                "tok_s": best_peer["tok_s"]}
        best_strata = max((r["tok_s"] for (s, _), r in strata.items() if s == "fixed"), default=None)
        if best_strata:
            summary["strata_best_vs_peer_best"] = best_strata / best_peer["tok_s"]
    fixed = sorted((n, r) for (s, n), r in strata.items() if s == "fixed")
    decode = [r.get("decode_tok_s") or 0.0 for _, r in fixed]
    summary["decode_rises_with_concurrency"] = all(b >= a for a, b in zip(decode, decode[1:])) if decode else None
    return summary
