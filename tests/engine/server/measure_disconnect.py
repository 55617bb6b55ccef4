"""Measure how fast a dropped streaming client frees its slot, against the engine's step time.

Run: .venv/bin/python -m tests.engine.server.measure_disconnect [--repeats 10]
(A measurement, not a test: the suite only asserts the slot frees; this prints the figures.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.engine.server.real import random_checkpoint, real_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    ckpt = random_checkpoint(Path(tempfile.mkdtemp()))
    free_ms, step_ms = [], []
    with real_server(str(ckpt), batch=2, context=1024) as (url, client, _):
        body = {"model": client.model_name, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        for _ in range(args.repeats):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
                lines = resp.iter_lines()
                for _ in range(20):
                    next(lines)
                steps0, t0 = client.engine.steps, time.perf_counter()
                for _ in range(20):
                    next(lines)
                step_ms.append((time.perf_counter() - t0) * 1000 / max(1, client.engine.steps - steps0))
                rid = next(json.loads(ln[6:])["id"] for ln in lines if ln.startswith("data: {"))
                dropped_s = time.time()  # the bus stamps events with time.time()
            aborted = None
            while aborted is None:
                aborted = next((e for e in client.bus.history() if getattr(e, "request_id", None) == rid
                                and getattr(e, "state", None) == "aborted"), None)
                time.sleep(0.001)
            free_ms.append((aborted.ts - dropped_s) * 1000)
    print(f"engine step: median {statistics.median(step_ms):.1f} ms; "
          f"client drop -> slot 'aborted' event: median {statistics.median(free_ms):.1f} ms, "
          f"max {max(free_ms):.1f} ms over {args.repeats} drops")


if __name__ == "__main__":
    main()
