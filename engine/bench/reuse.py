"""`strata-engine bench reuse`: time to first token of a prompt the engine has seen before (its prefix comes
from the prefix-cache tier) against the same prompt fresh, in one run for each way the tier can serve it:

- `copy`: the tier on the compute device with its own blocks (SHARED_PREFIX off): the prefix is copied in;
- `shared`: the tier's blocks in the KV pool (SHARED_PREFIX on): the prefix is mapped into the slot, not copied;
- `peer`, when `--peer-device` is given: the tier on that second GPU (copied across devices).

One engine per row (1 slot). Each row: `--pairs` distinct prompts of the size, each fresh then again; the fresh
TTFT, the reused TTFT, the prompt tokens the tier served and their ratio (the reuse target: the second TTFT a
small fraction of the first) of the last pair, every pair's TTFTs (`fresh_ttft_s_each`, `reused_ttft_s_each`),
and the tier blocks the slots mapped (`shared_blocks`) and copied (`copied_blocks`) since the engine started.
Why pairs: a reused prompt's tail (the tokens past its last whole tier block) is a short chunk deep into a span,
whose graph is captured on its (tokens, span) bucket's second sight and replayed from the third (docs/GRAPHS.md,
"Short prompt chunks"); the first pair's reuse runs it eagerly, the second captures it, the third is what a
server that has seen prompts of that length before does. The last reuse's time is taken apart: its tail chunk
(`reused_chunk_s`, device-synchronized) and the rest (`reused_other_s`); one more pair then runs its reuse under
cProfile (`reused_host_cum_ms`, `reused_host_own_ms`: the host functions that took the longest).
"""

from __future__ import annotations

import argparse
import cProfile
from typing import Any

from engine.bench.common import device_of, emit, random_prompt, save_partial
from engine.bench.engine_driver import BenchEngine, StepLog, build_engine, generate_all
from engine.bench.profile import host_functions

_CONTEXT_MARGIN_TOKENS = 64
_WARMUP_PROMPT_TOKENS = 256


def _drain(bench: BenchEngine) -> None:
    """Step until the engine is idle: the tier fills of a finished prompt's blocks run in later steps."""
    for _ in range(10_000):
        if not bench.engine.has_work:
            return
        bench.step()


def _host_profile(bench: BenchEngine, prompt: list[int], top: int = 25) -> dict[str, Any]:
    """One more pair, its reuse under cProfile (slower: not a speed figure): the functions with the most time in
    the reuse, cumulative (`reused_host_cum_ms`: where the time nests) and own (`reused_host_own_ms`)."""
    generate_all(bench, [prompt], 1)
    _drain(bench)
    profiler = cProfile.Profile()
    profiler.enable()
    stats = generate_all(bench, [prompt], 1)
    profiler.disable()
    _drain(bench)
    entries = host_functions(profiler)

    def ranked(key: int) -> dict[str, float]:
        return {e[0]: round(e[key] * 1e3, 3) for e in sorted(entries, key=lambda e: e[key], reverse=True)[:top]}
    return {"reused_profiled_ttft_s": stats.ttft_s[0], "reused_host_cum_ms": ranked(3),
            "reused_host_own_ms": ranked(2)}


_PATHS = {"copy": (None, False), "shared": (None, True)}  # path -> (peer device, SHARED_PREFIX)


def _placement_row(args: argparse.Namespace, path: str, size: int) -> dict[str, Any]:
    peer, shared = _PATHS.get(path, (args.peer_device, False))
    bench = build_engine(args, batch=1, context=size + _CONTEXT_MARGIN_TOKENS, peer_device=peer,
                         switches={"SHARED_PREFIX": shared})
    try:
        vocab = bench.engine.lm.config.vocab_size
        # capture the small buckets and the reused prompt's tail bucket outside the timed requests
        generate_all(bench, [random_prompt(min(_WARMUP_PROMPT_TOKENS, size), vocab, seed=7)], 2)
        _drain(bench)
        fresh_s, reused_s = [], []
        for pair in range(max(1, args.pairs)):
            prompt = random_prompt(size, vocab, seed=11 + pair)
            fresh = generate_all(bench, [prompt], 1)
            _drain(bench)
            with StepLog(bench) as log:
                again = generate_all(bench, [prompt], 1)
            parts = log.summary()
            _drain(bench)
            fresh_s.append(fresh.ttft_s[0])
            reused_s.append(again.ttft_s[0])
        profiled = _host_profile(bench, random_prompt(size, vocab, seed=11 + max(1, args.pairs)))
        tier = bench.engine.tier
        # how the reused blocks reached the slot: mapped from the KV pool (shared) or copied from own blocks
        return {"path": path, "tier_device": str(tier.device), "prompt_tokens": size, "fresh_ttft_s": fresh_s[-1],
                "reused_ttft_s": reused_s[-1], "cached_tokens": again.cached_tokens[0],
                "reused_over_fresh": reused_s[-1] / fresh_s[-1], "fresh_ttft_s_each": fresh_s,
                # where the last reuse's time went: its tail chunk (device-synchronized, as the pacer times it)
                # and the rest (admission, mapping the prefix, the first token's sampling, the steps' upkeep)
                "reused_tail_tokens": parts["during_chunk_tokens"], "reused_chunks": parts["during_chunks"],
                "reused_chunk_s": parts["during_chunk_s"],
                "reused_other_s": reused_s[-1] - parts["during_chunk_s"] - parts["during_fill_s"],
                "reused_ttft_s_each": reused_s, **profiled, "shared_blocks": tier.shared_blocks,
                "copied_blocks": tier.copied_in_blocks, "graphs_active": bench.graphs_active}
    finally:
        bench.close()


def run(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    paths = [*_PATHS] + (["peer"] if args.peer_device else [])
    rows: list[dict[str, Any]] = []
    for size in sorted(args.prompt_sizes):
        for path in paths:
            rows.append(_placement_row(args, path, size))
            save_partial(args, "reuse", rows, device)
    summary = {f"reused_over_fresh_{r['prompt_tokens']}_{r['path']}": r["reused_over_fresh"] for r in rows}
    emit(args, "reuse", rows, summary, device,
         ("path", "tier_device", "prompt_tokens", "fresh_ttft_s", "reused_ttft_s", "cached_tokens", "reused_over_fresh",
          "reused_tail_tokens", "reused_chunks", "reused_chunk_s", "reused_other_s", "shared_blocks", "copied_blocks",
          "graphs_active"))
    return 0
