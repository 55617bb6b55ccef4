"""Host cost of one engine snapshot publish (`Engine.publish_snapshot(force=True)`), on a real engine (default:
the random tiny checkpoint on CPU, 6 idle slots): the engine thread publishes one every 0.05 s between decode steps,
and at once after a step that admitted or finished a request. `--busy N`: N slots decoding, a step between two
publishes (only the publishes are timed), as a step that admitted or finished a request is followed.

    OMP_NUM_THREADS=1 python benchmarks/snapshot_publish_cost.py [--model random:tiny] [--device cpu] [--calls 2000]
    OMP_NUM_THREADS=1 python benchmarks/snapshot_publish_cost.py --busy 256 --calls 100
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from engine.api import SamplingParams  # noqa: E402
from engine.bench.common import device_of, prepare_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.orchestration.engine import Engine  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--busy", type=int, default=0, help="slots decoding, a step between two publishes")
    args = parser.parse_args()
    device = device_of(args.device)
    config = EngineConfig(model=prepare_model(args.model, device), device=str(device), batch=max(6, args.busy),
                          context=2048, step_token_budget=8192)
    engine = Engine(config, EventBus(history=1000))
    params = SamplingParams(max_tokens=2 * args.calls + 100, temperature=0.0, ignore_eos=True)
    for i in range(args.busy):
        engine.add_request(f"b{i}", [3 + (i + j) % 200 for j in range(32)], params)
    while engine.sched.num_waiting or engine.sched.num_running < args.busy:
        engine.step()
    for _ in range(50):  # warm: the first publishes resolve what later ones reuse
        engine.publish_snapshot(force=True)
    spent_s = 0.0
    for _ in range(args.calls):
        if args.busy:
            engine.step()
        start = time.perf_counter()
        engine.publish_snapshot(force=True)
        spent_s += time.perf_counter() - start
    print(f"publish_snapshot, {args.busy} slots decoding: {spent_s / args.calls * 1e6:.1f} us per call")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
