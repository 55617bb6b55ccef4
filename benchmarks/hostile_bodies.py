"""/health latency while hostile request bodies are being handled (issue 15, item 3).

Starts `strata-engine serve` (builtin:strata-tiny on CPU, its real tokenizer) in its own process, sends
large bodies at once (token ids, text, text without spaces, chat text, deep nesting, one over the body limit)
from threads, while a prober process of its own (as a liveness probe is: a prober sharing the senders' GIL
measures their threads, not the server) asks /health every 10 ms until they are all answered. Prints one JSON
line a round: p50/p99/max /health latency in ms, the statuses the bodies got and how long each took (from the
first byte sent to the answer: httpx sends a whole body before it reads the answer); then one line with each
body's p50/p99 seconds over the rounds, the /health p99 over all probes and the load average before and after.
`--only NAME` sends that body alone each round (its time is then its own, not its wait behind the others);
`--busy-loops N` runs N spinning processes beside it all (a loaded machine). `--prober-nice N` runs the prober at
that nice value (negative needs root or CAP_SYS_NICE), as a kubelet runs in its own system slice: on a loaded box a
prober at the default priority waits for a core itself, and its latencies then measure that wait too.

    python benchmarks/hostile_bodies.py [--body-mib 7] [--rounds 1] [--only text_unspaced] [--busy-loops 2]
                                        [--prober-nice -10]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time

import httpx
from seed_process import EngineProcess



def bodies(model: str, body_mib: float) -> dict[str, bytes]:
    n_bytes = int(body_mib * (1 << 20))
    words = "word " * (n_bytes // 5)
    return {
        "token_ids": json.dumps({"model": model, "prompt": [12] * (n_bytes // 4)}).encode(),
        "text": json.dumps({"model": model, "prompt": words}).encode(),
        # far past the context with no word start to cut at (CJK, base64): tokenized whole before heads were
        "text_unspaced": json.dumps({"model": model, "prompt": "日本語の文章" * (n_bytes // 18)},
                                    ensure_ascii=False).encode(),
        "chat_text": json.dumps({"model": model, "messages": [{"role": "user", "content": words}]}).encode(),
        "nested": b'{"a":' * (n_bytes // 5),
        "over_limit": json.dumps({"model": model, "prompt": "x" * (9 << 20)}).encode(),
    }


def measure(url: str, sent: dict[str, bytes], only: str | None = None, prober_nice: int = 0) -> dict:
    results: dict[str, tuple[int, float]] = {}

    def send(name: str, body: bytes) -> None:
        path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
        t0 = time.perf_counter()
        try:
            status = httpx.post(url + path, content=body, headers={"content-type": "application/json"},
                                timeout=300).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        results[name] = (status, round(time.perf_counter() - t0, 3))

    threads = [threading.Thread(target=send, args=item) for item in sent.items()
               if only is None or item[0] == only]
    receiving, sending = multiprocessing.Pipe(duplex=False)
    finished = multiprocessing.Event()
    prober = multiprocessing.Process(target=probe_health, args=(url, finished, sending, prober_nice),
                                     daemon=True)
    prober.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finished.set()
    latencies_ms = sorted(receiving.recv())
    prober.join(10)
    pick = lambda q: round(latencies_ms[min(len(latencies_ms) - 1, int(q * len(latencies_ms)))], 1)  # noqa: E731
    return {"health_polls": len(latencies_ms), "health_p50_ms": pick(0.5), "health_p99_ms": pick(0.99),
            "health_max_ms": round(latencies_ms[-1], 1), "bodies": results, "health_ms": latencies_ms}


def probe_health(url: str, finished, reply, nice: int = 0) -> None:
    """Ask /health every 10 ms until `finished` is set (and at least once); send the latencies in ms back."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    latencies_ms: list[float] = []
    with httpx.Client(timeout=30) as health:
        while not latencies_ms or not finished.is_set():
            t0 = time.perf_counter()
            health.get(url + "/health").raise_for_status()
            latencies_ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.01)
    reply.send(latencies_ms)


def _may_raise_priority() -> bool:
    """Whether this process may take a negative nice value (tried in a child, which then exits)."""
    child = multiprocessing.Process(target=_raise_priority)
    child.start()
    child.join()
    return child.exitcode == 0


def _raise_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -1)
    except PermissionError:
        sys.exit(1)


def spin(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(rounds: list[dict]) -> dict:
    """Each body's p50/p99 seconds over the rounds, and /health's p99 over every poll of every round."""
    health = [ms for r in rounds for ms in r["health_ms"]]
    times: dict[str, list[float]] = {}
    for r in rounds:
        for name, (_, seconds) in r["bodies"].items():
            times.setdefault(name, []).append(seconds)
    return {"rounds": len(rounds), "health_polls": len(health),
            "health_p99_ms": round(quantile(health, 0.99), 1) if health else None,
            "bodies_p50_p99_s": {name: [quantile(t, 0.5), quantile(t, 0.99)] for name, t in times.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--body-mib", type=float, default=7.0, help="size of each hostile body (default 7)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=["token_ids", "text", "text_unspaced", "chat_text", "nested",
                                           "over_limit"], help="send this body alone each round")
    parser.add_argument("--busy-loops", type=int, default=0, help="spinning processes beside it all (default 0)")
    parser.add_argument("--prober-nice", type=int, default=0,
                        help="the prober's nice value (default 0; negative needs root or CAP_SYS_NICE)")
    args = parser.parse_args()
    if args.prober_nice < 0 and not _may_raise_priority():
        parser.error(f"--prober-nice {args.prober_nice}: raising a priority needs root or CAP_SYS_NICE")
    load_before = os.getloadavg()
    engine = EngineProcess([sys.executable, "-m", "engine.cli", "serve", "--device", "cpu", "--port", "0",
                            "--log-level", "warning"],
                           {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        try:
            url = engine.wait_ready(120)
        except RuntimeError as exc:
            print(f"serve did not start: {exc}", file=sys.stderr)
            return 1
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        spinners = [multiprocessing.Process(target=spin, args=(24 * 3600,), daemon=True)
                    for _ in range(args.busy_loops)]
        for p in spinners:
            p.start()
        sent = bodies(model, args.body_mib)  # built once: building them each round loaded the machine too
        rounds = []
        for _ in range(args.rounds):
            rounds.append(measure(url, sent, args.only, args.prober_nice))
            print(json.dumps({k: v for k, v in rounds[-1].items() if k != "health_ms"}), flush=True)
        for p in spinners:
            p.terminate()
        print(json.dumps({**summary(rounds), "load_average_before_after": [round(load_before[0], 2),
                                                                         round(os.getloadavg()[0], 2)]}), flush=True)
    finally:
        engine.stop(timeout_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
