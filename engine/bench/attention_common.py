"""What the attention bench's decode and prefill rows share (the model shape, a filled one-layer cache, the timer),
and with the linear bench, the `--tune` parsing and the per-case timer."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from engine.errors import ConfigError
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from engine.exec.cuda_streams import Streams

HQ, HKV, HEAD_DIM = 16, 8, 128  # the 0.6B shape's attention


def graph_ms(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call of `fn`, replayed from a CUDA graph of `iters` calls (CPU: timed eagerly)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    stream = Streams(torch.device("cuda")).capture  # one capture stream, as the engine's graphs have
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / (3 * iters)
    del graph
    return ms


def time_launch_shapes(row: dict[str, Any], shapes: list[tuple[str, Callable[[], Callable[[], Any]]]],
                       iters: int, expected: torch.Tensor | None = None) -> None:
    """Each kernel launch shape's ms per read into `row` (`shapes`: its column name and a builder of the read),
    and with `expected` its max abs error against it (`NAME_max_err`: a faster shape must also be right); a
    shape that does not fit the device is a result too (`NAME_error`)."""
    for name, build in shapes:
        try:
            read = build()
            if expected is not None:
                row[f"{name}_max_err"] = round((read().float() - expected.float()).abs().max().item(), 5)
            row[f"{name}_ms"] = round(graph_ms(read, iters), 4)
        except Exception as exc:  # noqa: BLE001 - a launch shape that does not fit is a result too
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"


def finish_row(row: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The kernel's speed-up over the gathering path, and the row's memory back (the caller dropped its cache)."""
    if "triton_ms" in row and "torch_ms" in row:
        row["triton_speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def filled_cache(context: int, batch: int, storage: str, dtype: torch.dtype, device: torch.device) -> SlotKVCache:
    geo = KVGeometry(1, batch, HKV, HEAD_DIM, context, 64)
    cache = SlotKVCache(geo, storage, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for pool in (cache.k[0], cache.v[0]):
        if storage == "int8":
            pool.copy_(torch.randint(-127, 128, pool.shape, generator=gen, device=device, dtype=torch.int8))
        else:
            pool.normal_(generator=gen)
    for scale in (*cache.k_scale, *cache.v_scale):
        scale.uniform_(0.005, 0.02, generator=gen)
    return cache


def launch_shapes(option: str, text: str, config: type) -> list:
    """`--tune 128x4x2,64x4x3` -> configs, field by field in the dataclass's order: a whole number for an int
    field, a word for a str field (`128x64x4x3xtmax132`); the leading whole numbers are required, the fields after
    them optional (left out, their defaults). Anything else is a ConfigError naming the spec."""
    is_int = [f.type in (int, "int") for f in dataclasses.fields(config)]
    required = is_int.index(False) if False in is_int else len(is_int)
    shapes = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        parts = spec.split("x")
        ok = required <= len(parts) <= len(is_int) and all(
            (p.isdigit() and int(p) > 0) if whole else p.isidentifier() for whole, p in zip(is_int, parts))
        if not ok:
            kinds = "x".join(("N" if whole else "WORD") + ("" if i < required else "?")
                             for i, whole in enumerate(is_int))
            raise ConfigError(option, text, f"{spec!r}: expected up to {len(is_int)} fields joined by 'x' "
                              f"({kinds}; N a positive whole number)")
        try:
            shapes.append(config(*(int(p) if whole else p for whole, p in zip(is_int, parts))))
        except ValueError as exc:  # the config's own check (a word it does not know)
            raise ConfigError(option, text, f"{spec!r}: {exc}") from None
    return shapes


def timed_row(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one bench case, its wall seconds in `bench_s`, printed as it ends (a killed run still shows its rows)."""
    t0 = time.perf_counter()
    row = case()
    row["bench_s"] = round(time.perf_counter() - t0, 1)
    print(row, flush=True)
    return row
