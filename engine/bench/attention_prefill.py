"""`strata-engine bench attention`'s prefill rows: one layer's attention for one prompt chunk over a cached prefix.

For each prefix depth x KV storage: a one-layer SlotKVCache of one slot filled to prefix + chunk tokens, the
chunk's queries at positions [prefix, prefix + chunk), then the time of one attention read through
- `torch`: the reference backend as the engine runs a chunk without PAGED_ATTN: on CUDA, where the flash kernel
  takes the shapes, the slot's keys up to the chunk's end gathered through the block table, then fused causal
  SDPA (`SlotKVCache.bind_chunk`); elsewhere masked SDPA or the blocked online softmax;
- `triton`: the paged prefill kernel reading the pool in place (engine.model.attention.triton_prefill);
- for comparison, with `--backends`: `cudnn` / `flash` (vendor SDPA over the gathered prefix,
  engine.bench.attention_sdpa) and `dense` / `gather_dense` (a Triton flash kernel over contiguous keys,
  engine.bench.attention_dense: what the paging costs the kernel).
Timed like the decode rows (engine.bench.attention_common.graph_ms: a CUDA graph of `--iters` calls, replayed). `tflops` counts
the causal attention's dot products (4 x chunk x (prefix + chunk / 2) x Hq x D) over the time. `--prefill-tune`
times the kernel at other launch shapes (`QUERIESxTILExWARPSxSTAGES`, see PrefillConfig) in the same run.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import torch

from engine.bench.attention_common import (HEAD_DIM, HQ, filled_cache, finish_row,
                                           graph_ms, time_launch_shapes)
from engine.model.attention.triton_paged_config import PrefillConfig

DTYPE = torch.bfloat16  # the serving compute dtype on the GPU


def _tuned(cache: Any, q: torch.Tensor, positions: torch.Tensor, config: PrefillConfig) -> Callable[[], Any]:
    from engine.model.attention.triton_prefill import paged_prefill_attention

    scales = cache.scales(0)
    return lambda: paged_prefill_attention(q, cache.k[0], cache.v[0], *scales, cache.block_table, cache.slots,
                                           positions, cache.span_tokens, cache.geometry.context_tokens, config)


def _comparison_backend(name: str, cache: Any, q: torch.Tensor, prefix: int, span: int) -> Callable[[], Any] | None:
    """A read that is not the engine's, for comparison; None for a name that is not one. `cudnn` / `flash`: vendor
    SDPA over the gathered prefix (engine.bench.attention_sdpa; `cudnn32k`: its keys 32K at a time); `dense`: a
    Triton flash kernel over keys gathered once beforehand, contiguous (engine.bench.attention_dense;
    `dense128x64x8x3`: at that QUERIESxTILExWARPSxSTAGES); `gather_dense`: the same with the gather in every read."""
    slots = torch.zeros(1, dtype=torch.long, device=q.device)
    dense = re.fullmatch(r"(gather_)?dense(?:(\d+)x(\d+)x(\d+)x(\d+))?", name)
    if dense is not None and (q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        from engine.bench.attention_dense import dense_prefill_attention

        shape = [int(x) for x in dense.groups()[1:]] if dense.group(2) else []

        def gathered() -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = cache.read(0, slots, 0, span)
            return keys.contiguous(), values.contiguous()

        if dense.group(1):
            return lambda: dense_prefill_attention(q, *gathered(), prefix, *shape)
        once = gathered()
        return lambda: dense_prefill_attention(q, *once, prefix, *shape)
    match = re.fullmatch(r"(cudnn|flash)(?:(\d+)k)?", name)
    if match is None or q.device.type != "cuda":
        return None
    from engine.bench.attention_sdpa import sdpa_prefill_attention

    segment = int(match.group(2)) * 1024 if match.group(2) else max(1, prefix)

    def read() -> torch.Tensor:
        cache.bind(slots, span)
        return sdpa_prefill_attention(cache, 0, q, prefix, match.group(1), segment)
    return read


def _timed_ms(fn: Callable[[], Any], iters: int, row: dict[str, Any], name: str) -> float:
    """graph_ms, or where the read cannot be captured, event-timed eager calls (`NAME_eager` says so)."""
    try:
        return graph_ms(fn, iters)
    except Exception as exc:  # noqa: BLE001 - a read that cannot be captured is still timed, and marked
        row[f"{name}_eager"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def prefill_case(prefix: int, chunk: int, storage: str, device: torch.device, iters: int, backends: list[str],
                 tune: list[PrefillConfig]) -> dict[str, Any]:
    """One prefill row: the chunk's attention over `prefix` cached tokens, per backend."""
    cache = filled_cache(prefix + chunk, 1, storage, DTYPE, device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    positions = torch.arange(prefix, prefix + chunk, device=device).view(1, -1)
    q = torch.randn(1, HQ, chunk, HEAD_DIM, device=device, dtype=DTYPE)
    span = prefix + chunk
    fused = cache.chunk_fusable(HQ, chunk)  # what the runner decides for this chunk

    def reference() -> torch.Tensor:
        if fused:
            cache.bind_chunk(slots, span, prefix, chunk)
        else:
            cache.bind(slots, span)
        return cache.reference.attend(cache, 0, q, positions)

    def kernel() -> torch.Tensor:
        cache.bind(slots, span)
        return cache.kernel.paged(cache, 0, q, positions)  # the kernel itself, whatever PAGED_PREFILL says

    flops = 4 * chunk * (prefix + chunk / 2) * HQ * HEAD_DIM
    row: dict[str, Any] = {"case": "prefill", "context": span, "prefix": prefix, "chunk": chunk, "batch": 1,
                           "q_len": chunk, "kv": storage, "torch_path": "gather+flash" if fused else "gather+sdpa"}
    expected = reference()
    runs: dict[str, Callable[[], Any]] = {"torch": reference}
    if cache.kernel is not None:
        runs["triton"] = kernel
    for name in backends:
        other = _comparison_backend(name, cache, q, prefix, prefix + chunk)
        if other is not None:
            runs[name] = other
    for name in backends:
        if name not in runs:
            continue
        try:
            err = (runs[name]().float() - expected.float()).abs().max().item()
            ms = _timed_ms(runs[name], iters, row, name)
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 3)
            row[f"{name}_max_err"] = round(err, 5)
        except Exception as exc:  # noqa: BLE001 - one backend failing is a figure to report, not a crash
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    cache.bind(slots, span)
    time_launch_shapes(row, [(f"q{c.query_tokens}_tile{c.tile_tokens}_w{c.num_warps}_s{c.num_stages}_{c.loads}"
                              + (f"_split{c.split_programs}" if c.split_programs else ""),
                              lambda c=c: _tuned(cache, q, positions, c))
                             for c in (tune if cache.kernel is not None else [])], iters, expected)
    del cache
    return finish_row(row, device)
