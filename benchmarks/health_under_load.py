"""/health latency while clients keep sending big token-id prompts.

Starts `strata-engine serve` (builtin:strata-tiny on CPU) in its own process; CLIENTS senders each send
token-id prompts of BODY_MIB (far over the context, so each is refused with 400 once parsed) back to back
for SECONDS from their own processes, while this process polls /health every 10 ms. Prints one JSON
line: /health p50/p99/max in ms, how many polls, and how many bodies were answered with which status.

    python benchmarks/health_under_load.py [--clients 5] [--body-mib 8] [--seconds 20]
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


def measure(url: str, model: str, clients: int, body_mib: float, seconds: float) -> dict:
    ids = int(body_mib * (1 << 20)) // 4  # "12, " per id
    body = json.dumps({"model": model, "prompt": [12] * ids, "max_tokens": 1}).encode()
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
    latencies_ms.sort()
    pick = lambda q: round(latencies_ms[min(len(latencies_ms) - 1, int(q * len(latencies_ms)))], 1)  # noqa: E731
    return {"clients": clients, "body_bytes": len(body), "seconds": seconds, "health_polls": len(latencies_ms),
            "health_p50_ms": pick(0.5), "health_p99_ms": pick(0.99), "health_max_ms": round(latencies_ms[-1], 1),
            "bodies": {str(k): v for k, v in sorted(statuses.items(), key=str)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=5, help="concurrent senders (default 5)")
    parser.add_argument("--body-mib", type=float, default=8.0, help="size of each token-id body (default 8)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the senders keep sending")
    args = parser.parse_args()
    engine = EngineProcess([sys.executable, "-m", "engine.cli", "serve", "--device", "cpu", "--port", "0",
                            "--log-level", "warning", "--max-body-mib", str(max(16, int(args.body_mib * 2)))],
                           {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        try:
            url = engine.wait_ready(120)
        except RuntimeError as exc:
            print(f"serve did not start: {exc}", file=sys.stderr)
            return 1
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(json.dumps(measure(url, model, args.clients, args.body_mib, args.seconds)), flush=True)
    finally:
        engine.stop(timeout_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
