"""Host cost of one engine snapshot publish (`Engine.publish_snapshot(force=True)`), on a real engine (default:
the random tiny checkpoint on CPU, 6 slots): the engine thread publishes one every 0.05 s between decode steps.

    OMP_NUM_THREADS=1 python benchmarks/snapshot_publish_cost.py [--model random:tiny] [--device cpu] [--calls 2000]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from engine.bench.common import device_of, prepare_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.orchestration.engine import Engine  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = device_of(args.device)
    config = EngineConfig(model=prepare_model(args.model, device), device=str(device), batch=6, context=2048)
    engine = Engine(config, EventBus(history=1000))
    for _ in range(50):  # warm: the first publishes resolve what later ones reuse
        engine.publish_snapshot(force=True)
    start = time.perf_counter()
    for _ in range(args.calls):
        engine.publish_snapshot(force=True)
    print(f"publish_snapshot: {(time.perf_counter() - start) / args.calls * 1e6:.1f} us per call")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
