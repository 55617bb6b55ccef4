"""`strata-engine bench kvspill`: decode rate of slots whose KV is partly on the host (`--kv-resident`), against
the same slots with room, and against the PCIe floor.

Two slots (`--slots`) decode prompts of `--prompt-tokens`. With room: every slot's whole context on the device. Spilling:
`--kv-resident` tokens per slot and a shared pool of one slot's window, the context sized so that the pool holds
(2 - host fraction) of one slot's non-resident KV (default fraction 0.5: while one slot's forward runs, half of
the other's non-resident blocks are spilled, and its next forward fetches them back first). The tier has
nothing to give in both runs, as on the seed's card that it fills by design: started at 0 MiB, and the pool's
source answers 0 MiB (on CUDA the tier otherwise regrows into free VRAM and the pool grows out of the spill:
nothing would spill).

With more slots the pool keeps
that size, so every forward fetches what the others spilled (the seed's six long prompts on a full card).

`same_tokens` compares the spill run's greedy tokens with the room run's; `same_tokens_as_alone` with each
prompt decoded on its own with room (the forward sizes of the spill run, see `tokens_alone`).

The floor: bytes fetched per decode step / the measured host-to-device bandwidth of a pinned copy (`h2d_gib_s`),
i.e. the step time the copies alone need; `floor_tok_s` is the decode rate that allows (a token per slot a step).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

from engine.bench.common import device_of, emit, random_prompt, save_partial, sync
from engine.bench.engine_driver import build_engine, generate_all
from engine.errors import ConfigError

_H2D_COPY_MIB = 256
_BLOCK_TOKENS = 64
_DEFAULT_RESIDENT_TOKENS = 1024


def h2d_gib_s(device: torch.device, mib: int = _H2D_COPY_MIB) -> float:
    """Measured host-to-device bandwidth of one pinned copy (best of three)."""
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return mib / 1024 / best


def spill_context(prompt_tokens: int, new_tokens: int, resident_tokens: int, host_fraction: float,
                  lookahead_tokens: int = 2) -> int:
    """A context whose pool (one slot's window, W blocks) leaves `host_fraction` of the other slot's N
    non-resident blocks on the host while one slot's forward holds its N: W = (2 - fraction) x N."""
    resident = -(-resident_tokens // _BLOCK_TOKENS)
    n = -(-(prompt_tokens + new_tokens + lookahead_tokens) // _BLOCK_TOKENS) - resident
    window = math.ceil((2.0 - min(1.0, max(0.0, host_fraction))) * n)
    return (resident + window) * _BLOCK_TOKENS


def measure(args: argparse.Namespace, label: str, **overrides: Any) -> dict[str, Any]:
    bench = build_engine(args, batch=args.slots, tier_budget_mib=0.0, **overrides)
    try:
        if bench.engine.kv.paging is not None:
            bench.engine.kv.paging.take_memory = lambda mib, reason: 0.0  # a tier with nothing to give
        vocab = bench.engine.lm.config.vocab_size
        generate_all(bench, [random_prompt(args.prompt_tokens, vocab, seed=900 + i) for i in range(args.slots)],
                     args.new_tokens)  # captures the buckets the timed run needs
        paging = bench.engine.kv.paging
        # Synchronized first: a CUDA fetch's figures are counted once its copy has completed (engine.exec.kv.paging).
        sync(bench.engine.device)
        before = paging.snapshot().to_json() if paging is not None else None
        stats = generate_all(bench, [random_prompt(args.prompt_tokens, vocab, seed=i) for i in range(args.slots)],
                             args.new_tokens)
        row: dict[str, Any] = {"run": label, "context": bench.config.context,
                               "kv_resident": bench.config.kv_resident, "decode_tok_s": stats.decode_tok_s,
                               "steps": stats.steps, "tokens": stats.tokens, "token_ids": stats.token_ids}
        if paging is not None:
            sync(bench.engine.device)
            after = paging.snapshot().to_json()
            steps = max(1, stats.steps)
            row.update({key: (after[key] - before[key]) / steps for key in ("fetched_mib", "spilled_mib",
                                                                               "fetch_ms", "spill_ms")})
            row["pool_blocks"] = after["pool_blocks"]
    finally:
        bench.close()
    return row


def tokens_alone(args: argparse.Namespace, context: int) -> list[list[int]]:
    """Each prompt's greedy tokens decoded on its own, with room: the control for `same_tokens`. The spill run
    decodes its slots in forwards of fewer rows than the room run (a pool sized below two slots), and a forward's
    row count may change bf16 rounding (on a GPU `same_tokens` can say no in bf16 where fp32 keeps every token):
    equal to these, the spill run lost nothing."""
    bench = build_engine(args, batch=args.slots, tier_budget_mib=0.0, context=context, kv_resident=None)
    try:
        vocab = bench.engine.lm.config.vocab_size
        return [generate_all(bench, [random_prompt(args.prompt_tokens, vocab, seed=i)], args.new_tokens).token_ids[0]
                for i in range(args.slots)]
    finally:
        bench.close()


def run(args: argparse.Namespace) -> int:
    if args.slots < 2:
        raise ConfigError("slots", args.slots, "kvspill needs at least 2 slots: one spills what the other fetches")
    device = device_of(args.device)
    resident = args.kv_resident or _DEFAULT_RESIDENT_TOKENS
    context = spill_context(args.prompt_tokens, args.new_tokens, resident, args.host_fraction)
    rows = [measure(args, "room", context=context, kv_resident=None)]
    save_partial(args, "kvspill", rows, device)
    rows.append(measure(args, "spill", context=context, kv_resident=resident))
    alone = tokens_alone(args, context)
    bandwidth = h2d_gib_s(device)
    spill = rows[1]
    spill["h2d_gib_s"] = bandwidth
    step_floor_s = spill["fetched_mib"] / 1024 / bandwidth if spill.get("fetched_mib") else 0.0
    spill["floor_tok_s"] = args.slots / step_floor_s if step_floor_s > 0 else None
    summary = {"same_tokens": rows[0]["token_ids"] == spill["token_ids"],
               "same_tokens_as_alone": spill["token_ids"] == alone,
               "spill_vs_room": (spill["decode_tok_s"] or 0) / rows[0]["decode_tok_s"]
               if rows[0]["decode_tok_s"] else None,
               "fetched_mib_per_step": spill.get("fetched_mib"), "h2d_gib_s": bandwidth,
               "floor_tok_s": spill["floor_tok_s"]}
    for row in rows:
        row.pop("token_ids")
    emit(args, "kvspill", rows, summary, device,
         ("run", "context", "kv_resident", "decode_tok_s", "fetched_mib", "fetch_ms", "spilled_mib", "spill_ms",
          "floor_tok_s", "steps"))
    return 0
