"""`strata-engine bench graphs`: what the graph cache captured, how long each capture took and its MiB.

Runs requests at each batch size (with `--batch-mtp` the drafter's graphs too) through an engine with the
graph cache on, then reads the cache's own snapshot and sums it per graph kind. On CPU the cache uses its CPU
backend (recorded closures: capture times are real, MiB are ~0), so the code path runs in CI.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

from engine.bench.common import device_of, emit, random_prompt
from engine.bench.engine_driver import build_engine, generate_all

_CONTEXT_MARGIN_TOKENS = 64


def per_kind(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per graph kind: how many graphs, their MiB and capture ms (total, mean, max), replays."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for graph in snapshot.get("graphs", []):
        groups[graph["kind"]].append(graph)
    rows = []
    for kind, graphs in sorted(groups.items()):
        ms = [g["capture_ms"] for g in graphs]
        rows.append({"kind": kind, "graphs": len(graphs), "mib": sum(g["mib"] for g in graphs),
                     "mib_max": max(g["mib"] for g in graphs), "capture_ms": sum(ms),
                     "capture_ms_mean": sum(ms) / len(ms), "capture_ms_max": max(ms),
                     "replays": sum(g.get("replays", 0) for g in graphs)})
    return rows


def run(args: argparse.Namespace) -> int:
    """Run each batch through a graph-cache engine, then summarize its snapshot per kind."""
    device = device_of(args.device)
    bench = build_engine(args, graph_cache_on_cpu=True, graphs=True, batch=max(args.batches),
                         context=args.prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS)
    try:
        vocab = bench.engine.lm.config.vocab_size
        for batch in args.batches:
            prompts = [random_prompt(args.prompt_tokens, vocab, seed=50 * batch + i) for i in range(batch)]
            generate_all(bench, prompts, args.new_tokens)
        snapshot = bench.graph_snapshot()
        wiring = bench.executor_wiring
        mtp_active = bench.engine.mtp_on
    finally:
        bench.close()
    rows = per_kind(snapshot)
    summary = {
        "graphs": sum(r["graphs"] for r in rows), "total_mib": sum(r["mib"] for r in rows),
        "total_capture_ms": sum(r["capture_ms"] for r in rows), "degraded": len(snapshot.get("degraded", [])),
        "mtp_active": mtp_active,
    }
    emit(args, "graphs", rows, summary, device, env_extra={"executor_wiring": wiring}, extra={"snapshot": snapshot})
    return 0
