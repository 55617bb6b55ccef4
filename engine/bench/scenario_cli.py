"""`strata-engine bench scenario NAME --url URL`: play one load scenario, print its table, write its JSON.

Torch-free: it only talks HTTP to a running server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from engine.bench.report import document, environment, print_report, write_json
from engine.errors import ConfigError
from engine.loadgen.scenarios import ScenarioProgress, run_scenario

_COLUMNS = ("label", "kind", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "decode_tok_s",
            "end_s", "finish_reason", "error")


def parse_sets(items: list[str]) -> dict[str, str]:
    """`["long_tokens=32000"]` -> {"long_tokens": "32000"}; the scenario coerces and checks the values."""
    params: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError("--set", item, "expected NAME=VALUE")
        params[name.strip()] = value.strip()
    return params


def _print_progress(progress: ScenarioProgress) -> None:
    print(f"[{progress.elapsed_s:7.2f} s] {progress.event:<11} {progress.message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every request completed and the server is healthy afterwards, 1 otherwise."""
    params = parse_sets(args.set)
    result = asyncio.run(run_scenario(args.name, args.url, args.api_key, on_progress=_print_progress,
                                      timeout_s=args.timeout_s, **params))
    data = result.to_json()
    summary = {"ok": result.ok, "wall_s": result.wall_s, **result.metrics,
               "health_before": result.health_before, "health_after": result.health_after}
    doc = document("scenario", data["requests"], summary, environment({"url": args.url, "model": result.model}),
                   {"scenario": args.name, **result.params})
    doc["scenario"] = data
    print_report(doc, _COLUMNS)
    for note in result.notes:
        print(f"note: {note}")
    for error in result.errors:
        print(f"error: {error}")
    print(f"wrote {write_json(args.json, doc)}")
    return 0 if result.ok else 1
