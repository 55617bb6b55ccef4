"""`strata-engine bench reuse`: time to first token of a prompt the engine has seen before (its prefix comes
from the prefix-cache tier) against the same prompt fresh, with the tier on the compute device (its blocks in the
KV pool: the reused prefix is mapped into the slot, not copied) and, when `--peer-device` is given, on that
second GPU (the blocks are copied across devices).

One engine per placement (1 slot). Each row: the fresh TTFT, the reused TTFT, the prompt tokens the tier
served, their ratio (the reuse target: the second TTFT a small fraction of the first), and the tier blocks
the slots mapped (`shared_blocks`) and copied (`copied_blocks`) since the engine started.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.bench.common import device_of, emit, random_prompt, save_partial
from engine.bench.engine_driver import BenchEngine, build_engine, generate_all

_CONTEXT_MARGIN_TOKENS = 64
_WARMUP_PROMPT_TOKENS = 256


def _drain(bench: BenchEngine) -> None:
    """Step until the engine is idle: the tier fills of a finished prompt's blocks run in later steps."""
    for _ in range(10_000):
        if not bench.engine.has_work:
            return
        bench.step()


def _placement_row(args: argparse.Namespace, peer: str | None, size: int) -> dict[str, Any]:
    bench = build_engine(args, batch=1, context=size + _CONTEXT_MARGIN_TOKENS, peer_device=peer)
    try:
        vocab = bench.engine.lm.config.vocab_size
        # capture the small buckets and the reused prompt's tail bucket outside the timed requests
        generate_all(bench, [random_prompt(min(_WARMUP_PROMPT_TOKENS, size), vocab, seed=7)], 2)
        _drain(bench)
        prompt = random_prompt(size, vocab, seed=11)
        fresh = generate_all(bench, [prompt], 1)
        _drain(bench)
        again = generate_all(bench, [prompt], 1)
        tier = bench.engine.tier
        # how the reused blocks reached the slot: mapped from the KV pool (shared) or copied from own blocks
        return {"tier_device": str(tier.device), "prompt_tokens": size, "fresh_ttft_s": fresh.ttft_s[0],
                "reused_ttft_s": again.ttft_s[0], "cached_tokens": again.cached_tokens[0],
                "reused_over_fresh": again.ttft_s[0] / fresh.ttft_s[0], "shared_blocks": tier.shared_blocks,
                "copied_blocks": tier.copied_in_blocks, "graphs_active": bench.graphs_active}
    finally:
        bench.close()


def run(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    placements = [None] + ([args.peer_device] if args.peer_device else [])
    rows: list[dict[str, Any]] = []
    for size in sorted(args.prompt_sizes):
        for peer in placements:
            rows.append(_placement_row(args, peer, size))
            save_partial(args, "reuse", rows, device)
    summary = {f"reused_over_fresh_{r['prompt_tokens']}_{r['tier_device']}": r["reused_over_fresh"] for r in rows}
    emit(args, "reuse", rows, summary, device,
         ("tier_device", "prompt_tokens", "fresh_ttft_s", "reused_ttft_s", "cached_tokens", "reused_over_fresh",
          "shared_blocks", "copied_blocks", "graphs_active"))
    return 0
