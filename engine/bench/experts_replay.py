"""`strata-engine bench experts-replay`: expert-cache hit rates of the slot policies on a routing trace (CPU).

Replays a trace against LRU, LRFU (the EXPERT_LFU switch) and Belady's oracle at each budget, given as a
percentage of a layer's experts (slots = round(E x pct / 100), at least one). The trace is a recorded file
(`--trace`, engine.exec.experts.trace's format: `bench experts --trace-out` or `ExpertStats.write_trace` on a
real model) or synthetic (`--synthetic uniform,skewed`, engine.bench.expert_traces: seeded, so the command
gives the same figures everywhere). Pure Python: these are hit rates, not speed; the replay is exactly what
the live cache does with the same slots (the engine's tests check that on the recorded traces).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any

from engine.bench.expert_traces import TRACE_KINDS, synthetic_trace
from engine.bench.report import document, print_report, write_json
from engine.errors import ConfigError
from engine.exec.experts.trace import MIN_HALF_LIFE_GROUPS, POLICIES, Access, hit_rate, read_trace, replay

COLUMNS = ("trace", "budget_pct", "slots", "lru", "lfu", "belady", "lfu_minus_lru", "accesses", "replay_s")


def _names(text: str, allowed: tuple[str, ...], param: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in allowed for n in names):
        raise ConfigError(param, text, f"expected comma-separated names from {', '.join(allowed)}")
    return names


def _traces(args: argparse.Namespace) -> list[tuple[str, int, list[Access]]]:
    """(name, experts per layer, accesses) of each trace to replay."""
    if args.trace:
        try:
            header, accesses = read_trace(args.trace)
        except (OSError, ValueError) as exc:
            raise ConfigError("trace", args.trace, str(exc)) from None
        experts = int(header.get("num_experts") or 1 + max(e for a in accesses for e in a.experts))
        return [(args.trace, experts, accesses)]
    out = []
    for kind in _names(args.synthetic, TRACE_KINDS, "synthetic"):
        try:
            accesses = synthetic_trace(kind, args.layers, args.experts, args.top_k, args.steps, args.batch, args.seed,
                                       zipf_s=args.zipf_s, locality=args.locality, request_steps=args.request_steps,
                                       drift=args.drift)
        except ValueError as exc:
            raise ConfigError("synthetic", kind, str(exc)) from None
        out.append((kind, args.experts, accesses))
    return out


def run(args: argparse.Namespace) -> int:
    """One row per trace and budget: each policy's hit rate."""
    from engine.bench.experts import budget_list, slots_for_pct

    policies = _names(args.policies, POLICIES, "policies")
    if not args.half_life >= MIN_HALF_LIFE_GROUPS:
        raise ConfigError("half_life", args.half_life, f"expected at least {MIN_HALF_LIFE_GROUPS}")
    budgets = sorted(budget_list(args.budgets))
    rows: list[dict[str, Any]] = []
    for name, experts, accesses in _traces(args):
        for pct in budgets:
            slots = slots_for_pct(pct, experts)
            t0 = time.perf_counter()
            row: dict[str, Any] = {"trace": name, "budget_pct": pct, "slots": slots, "accesses": len(accesses)}
            for policy in policies:
                row[policy] = hit_rate(replay(accesses, slots, policy, half_life=args.half_life))
            if row.get("lru") is not None and row.get("lfu") is not None:
                row["lfu_minus_lru"] = row["lfu"] - row["lru"]
            row["replay_s"] = time.perf_counter() - t0
            rows.append(row)
    summary = {"lfu_beats_lru_on": sorted({r["trace"] for r in rows if (r.get("lfu_minus_lru") or 0) > 0.005})}
    env = {"python": sys.version.split()[0], "machine": platform.machine()}
    params = {k: v for k, v in vars(args).items() if not callable(v)}
    doc = document("experts-replay", rows, summary, env, params)
    print_report(doc, COLUMNS)
    print(f"wrote {write_json(args.json, doc)}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, metavar="PATH", help="a recorded strata-expert-trace file (else synthetic)")
    p.add_argument("--synthetic", default="uniform,skewed", help="synthetic traces without --trace: uniform, skewed")
    p.add_argument("--budgets", default="5,15,30,50", help="percent of a layer's experts held in slots")
    p.add_argument("--policies", default="lru,lfu,belady", help="slot policies to replay: lru, lfu, belady")
    p.add_argument("--half-life", type=float, default=64.0, help="LRFU's half-life in a layer's accesses")
    p.add_argument("--layers", type=int, default=24, help="synthetic: sparse layers")
    p.add_argument("--experts", type=int, default=64, help="synthetic: experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="synthetic: experts per token")
    p.add_argument("--steps", type=int, default=2000, help="synthetic: decode steps")
    p.add_argument("--batch", type=int, default=1, help="synthetic: tokens per step")
    p.add_argument("--seed", type=int, default=0, help="synthetic: random.Random seed")
    p.add_argument("--zipf-s", type=float, default=1.0, help="skewed: popularity 1 / rank ** s")
    p.add_argument("--locality", type=float, default=0.3, help="skewed: chance a token keeps each previous expert")
    p.add_argument("--request-steps", type=int, default=256, help="skewed: steps per request (popularity drift)")
    p.add_argument("--drift", type=float, default=0.25, help="skewed: share of popularity ranks reshuffled per request")
