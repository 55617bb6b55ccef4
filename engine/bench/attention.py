"""`strata-engine bench attention`: one layer's attention over the serving KV cache, backend by backend.

Decode rows (`--rows decode`) here; prefill rows (a prompt chunk over a cached prefix, `--rows prefill`) in
engine.bench.attention_prefill. For each context x batch x queries per row x KV storage: a one-layer SlotKVCache of
`batch` slots filled to the context, every row's queries at its last positions (the span bucket = the context),
then the time of one attention read through
- `torch`: the reference backend as the engine runs it without PAGED_ATTN (keys gathered through the block
  table, then masked SDPA, or the blocked online softmax when the copy would pass 128 MiB);
- `triton`: the paged kernels reading the pool in place (engine.model.attention.triton_paged);
- `flex`: torch's FlexAttention (compiled) over a contiguous per-row copy of the same keys, bf16 and one query
  per row only (it takes no int8 KV; each shape compiles anew); contiguous is its best case: paging through a
  block mask only adds to it.
Each is captured in a CUDA graph of `--iters` calls and replayed, so launch overhead is not what is timed.
`kv_tb_s` is the KV bytes one read must touch (keys + values, int8 scales included) over the time, against
the device's ~4.3 TB/s. `max_err` is the largest difference from the reference's output. `--tune` times the
kernel at other launch shapes (`TILExWARPSxSTAGESxMIN_SPLIT_TILES`, see KernelConfig) in the same run.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from engine.bench.attention_common import (HEAD_DIM, HQ, HKV, filled_cache, finish_row, graph_ms, launch_shapes,
                                           time_launch_shapes, timed_row)
from engine.bench.attention_prefill import prefill_case
from engine.bench.common import device_of, emit
from engine.errors import ConfigError
from engine.exec.kv.cache import SlotKVCache
from engine.model.attention.triton_paged_config import KernelConfig, PrefillConfig

def _flex(q: torch.Tensor, cache: SlotKVCache, positions: torch.Tensor, context: int) -> Callable[[], Any]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b = q.shape[0]
    slots = torch.arange(b, device=q.device)
    k, v = cache.read(0, slots, 0, context)
    k, v = k.contiguous(), v.contiguous()

    def visible(bi, h, qi, ki):
        return ki <= positions[bi, qi]

    mask = create_block_mask(visible, b, None, q.shape[2], context, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def _tuned(cache: SlotKVCache, q: torch.Tensor, positions: torch.Tensor, config: KernelConfig) -> Callable[[], Any]:
    from engine.model.attention.triton_paged import paged_decode_attention

    scales = cache.scales(0)
    return lambda: paged_decode_attention(q, cache.k[0], cache.v[0], *scales, cache.block_table, cache.slots,
                                          positions, cache.span_tokens, cache.geometry.context_tokens, config)


def _case(context: int, batch: int, t: int, storage: str, device: torch.device, iters: int,
          backends: list[str], tune: list[KernelConfig]) -> dict[str, Any]:
    dtype = torch.bfloat16
    cache = filled_cache(context, batch, storage, dtype, device)
    slots = torch.arange(batch, device=device)
    positions = torch.arange(context - t, context, device=device).repeat(batch, 1)
    q = torch.randn(batch, HQ, t, HEAD_DIM, device=device, dtype=dtype)
    bytes_per_key = 2 * HKV * (HEAD_DIM * (1 if storage == "int8" else 2) + (4 if storage == "int8" else 0))
    kv_bytes = batch * context * bytes_per_key
    row: dict[str, Any] = {"case": "decode", "context": context, "batch": batch, "q_len": t, "kv": storage}
    cache.bind(slots, context)
    reference = cache.reference.attend(cache, 0, q, positions)
    runs: dict[str, Callable[[], Any]] = {"torch": lambda: cache.reference.attend(cache, 0, q, positions)}
    if cache.kernel is not None:
        runs["triton"] = lambda: cache.kernel.attend(cache, 0, q, positions)
    for name in backends:
        # Flex: bf16 only (no int8 KV), one compile per shape: measured at one query per row to bound its cost.
        if name not in runs and not (name == "flex" and storage == "bf16" and device.type == "cuda" and t == 1):
            continue
        try:
            fn = _flex(q, cache, positions, context) if name == "flex" else runs[name]
            err = (fn().float() - reference.float()).abs().max().item()
            ms = graph_ms(fn, iters)
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_kv_tb_s"] = round(kv_bytes / ms / 1e9, 3)
            row[f"{name}_max_err"] = round(err, 5)
        except Exception as exc:  # noqa: BLE001 - one backend failing is a figure to report, not a crash
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    time_launch_shapes(row, [(f"tile{c.tile_tokens}_w{c.num_warps}_s{c.num_stages}_m{c.min_split_tiles}_{c.loads}",
                              lambda c=c: _tuned(cache, q, positions, c))
                             for c in (tune if cache.kernel is not None else [])], iters)
    del cache
    return finish_row(row, device)


def run(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    tune = launch_shapes("tune", args.tune, KernelConfig)
    prefill_tune = launch_shapes("prefill_tune", args.prefill_tune, PrefillConfig)
    kinds = {r.strip() for r in args.rows.split(",") if r.strip()}
    if not kinds or kinds - {"decode", "prefill"}:
        raise ConfigError("rows", args.rows, "expected decode, prefill or both")
    storages = [s.strip() for s in args.kv_storage.split(",") if s.strip()]
    rows = []
    if "decode" in kinds:
        for context in args.contexts:
            for batch in args.batches:
                for t in args.q_lens:
                    for storage in storages:
                        rows.append(timed_row(lambda: _case(context, batch, t, storage, device, args.iters,
                                                            backends, tune)))
    if "prefill" in kinds:
        for prefix in args.prefill_prefixes:
            for storage in storages:
                rows.append(timed_row(lambda: prefill_case(prefix, args.prefill_chunk, storage, device,
                                                           args.iters, backends, prefill_tune)))
    best = [r for r in rows if "triton_speedup" in r]
    summary = {"cases": len(rows),
               "triton_faster_everywhere": bool(best) and all(r["triton_speedup"] > 1 for r in best),
               "min_triton_speedup": min((r["triton_speedup"] for r in best), default=None)}
    emit(args, "attention", rows, summary, device)
    return 0
