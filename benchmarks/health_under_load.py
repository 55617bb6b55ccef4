"""/health latency while clients keep sending big token-id prompts.

Starts `strata-engine serve` (builtin:strata-tiny on CPU) in its own process; CLIENTS senders each send
token-id prompts back to back for SECONDS from their own processes, while this process polls /health every
10 ms. Prints one JSON line: /health p50/p99/max in ms, how many polls, how many bodies were answered with
which status, the server process's CPU time meanwhile (in all, and per body answered) and the machine's load
average (1 min) before and after (the latencies mean little without it).

Two kinds of body:
- `--body-mib 8` (default): ids far past the context; each is refused with 400 from its first bytes.
- `--ids 262144 --past-vocab`: the server is started with a context that holds them (`--context`), and
  every id is the model's vocabulary size, so each body is read, parsed and validated whole, then refused
  with 400 at the vocabulary check (no prefill runs).

    python benchmarks/health_under_load.py [--clients 5] [--body-mib 8 | --ids N [--past-vocab]] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from typing import Any

import httpx
from seed_process import EngineProcess



def load(url: str, body: bytes, seconds: float, results: Any) -> None:
    """One sender (its own process, so the senders never hold the poller's GIL)."""
    statuses: Counter = Counter()
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < deadline:
            try:
                status = client.post(url + "/v1/completions", content=body,
                                     headers={"content-type": "application/json"}).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            statuses[str(status)] += 1
    results.put(dict(statuses))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) the process has used: /proc/PID/stat's utime and stime."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, model: str, clients: int, ids: int, token_id: int, seconds: float, server_pid: int) -> dict:
    body = json.dumps({"model": model, "prompt": [token_id] * ids, "max_tokens": 1}).encode()
    load_before = os.getloadavg()[0]
    cpu_before = cpu_s(server_pid)
    results: Any = multiprocessing.Queue()
    senders = [multiprocessing.Process(target=load, args=(url, body, seconds, results)) for _ in range(clients)]
    for p in senders:
        p.start()
    time.sleep(0.5)  # the first bodies are on the wire
    latencies_ms: list[float] = []
    with httpx.Client(timeout=30) as health:
        while any(p.is_alive() for p in senders) and results.qsize() < clients:
            t0 = time.perf_counter()
            health.get(url + "/health").raise_for_status()
            latencies_ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.01)
    statuses: Counter = Counter()
    for _ in senders:
        statuses.update(results.get(timeout=300))
    for p in senders:
        p.join()
    server_cpu_s = cpu_s(server_pid) - cpu_before
    latencies_ms.sort()
    pick = lambda q: round(latencies_ms[min(len(latencies_ms) - 1, int(q * len(latencies_ms)))], 1)  # noqa: E731
    return {"clients": clients, "ids": ids, "token_id": token_id, "body_bytes": len(body), "seconds": seconds,
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "health_polls": len(latencies_ms),
            "health_p50_ms": pick(0.5), "health_p99_ms": pick(0.99), "health_max_ms": round(latencies_ms[-1], 1),
            "bodies": {str(k): v for k, v in sorted(statuses.items(), key=str)}, "server_cpu_s": round(server_cpu_s, 2),
            "server_cpu_ms_per_body": round(1000 * server_cpu_s / max(1, sum(statuses.values())), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=5, help="concurrent senders (default 5)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--body-mib", type=float, default=8.0, help="size of each token-id body (default 8)")
    size.add_argument("--ids", type=int, help="ids in each prompt (instead of --body-mib)")
    parser.add_argument("--past-vocab", action="store_true",
                        help="with --ids: serve with a context that holds them, each id the vocabulary size "
                             "(every body parsed whole, then refused at the vocabulary check)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the senders keep sending")
    args = parser.parse_args()
    if args.past_vocab and args.ids is None:
        parser.error("--past-vocab needs --ids")
    ids = args.ids if args.ids is not None else int(args.body_mib * (1 << 20)) // 4  # "12, " per id
    body_mib = args.body_mib if args.ids is None else ids * 9 / (1 << 20)  # at most "1234567, " per id
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--device", "cpu", "--port", "0", "--log-level", "warning",
           "--max-body-mib", str(max(16, int(body_mib * 2)))]
    if args.past_vocab:
        cmd += ["--context", str(ids)]
    engine = EngineProcess(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        try:
            url = engine.wait_ready(120)
        except RuntimeError as exc:
            print(f"serve did not start: {exc}", file=sys.stderr)
            return 1
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        token_id = card["vocab_size"] if args.past_vocab else 12
        print(json.dumps(measure(url, card["id"], args.clients, ids, token_id, args.seconds, engine.proc.pid)),
              flush=True)
    finally:
        engine.stop(timeout_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
