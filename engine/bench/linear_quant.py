"""`strata-engine bench linear --quant fp8,fp8-block,int4`: a model's projections with quantized weights, each path
of engine.model.quant.kernels side by side with the libraries on the same shape.

Per weight of one decoder layer (qkv and gate/up fused, as FUSED_PROJ runs them; o; down), row count and format,
timed as `bench linear` times its rows (a CUDA graph of `--iters` products rotating through copies that fill
256 MiB, so each product reads its weight from HBM, not from the L2):
- `torch_ms`: F.linear on the bf16 weight (cuBLAS), the figure the quantized kernels must beat;
- `quant_ms`: what the engine runs (`path`: the path the rows take, `gemv` / `tc` / `dense` / `tinygemm`);
- `gemv_ms` (1-4 rows), `tc_ms` (5-256 rows; 16 and up where the GEMV also runs), `dense_ms` (16 rows and up):
  each path at its launch shape of the committed table (or the default), so the thresholds can be read off;
- `tinygemm_ms` (int4, groups tinygemm takes): PyTorch's own `torch._weight_int4pack_mm` on the weight repacked;
- `gemlite_ms`: gemlite's kernel, where the package is importable (it is not a dependency);
- each `--quant-tune` shape (`BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES`) on the GEMV (`g_<shape>_ms`, 1-4 rows) and the
  tensor-core path (`t_<shape>_ms`, 5-256 rows): one GPU run times every candidate; a shape ending in `xpairs`
  (int4 codes unpacked two at a time, engine.model.quant.tensor_core_pairs) on the tensor-core path of the
  layers it takes;
- `chunk_gemm`: what the prompt-chunk path runs here (an FP8 GEMM row-wise or block-scaled, or dequantize +
  cuBLAS bf16: the block-scaled GEMM where the device ran it right once, `kernels.prepare`);
- `*_max_err`: the largest difference from cuBLAS's product of the dequantized weight, over its largest value;
  `quant_tb_s`: the layout's bytes (codes and scales) over `quant_ms`; `speedup` = torch_ms / quant_ms; `ideal`
  = bf16 bytes / the layout's bytes (the speedup a kernel at bf16's bandwidth would reach).
`--table-out FILE`: the fastest measured shape per weight class and path, the tensor-core / prompt-chunk threshold
and the int4 backend, as a launch table (engine.model.quant.launch_table), merged into FILE's other devices.
Formats: fp8 (per channel: `--quantize fp8`, compressed-tensors FP8), fp8-block (Qwen's 128x128 blocks), int4
(group 128: `--quantize int4`, AWQ, GPTQ), int4-g32 (GGUF's Q4_0 / Q4_K), int8 (group 128), int8-g32 (Q8_0).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.bench.attention_common import launch_shapes, time_launch_shapes
from engine.errors import ConfigError

QUANT_FORMATS = ("fp8", "fp8-block", "int4", "int4-g32", "int8", "int8-g32")
_COLD_BYTES = 256 * 2**20  # copies of a weight rotate through this many bytes: over the L2 (50 MiB on an H200)
_GROUP = 128
_TC_MAX_ROWS = 256
_DENSE_MIN_ROWS = 16


def quant_formats(text: str) -> list[str]:
    """`fp8,int4` -> the formats, in order; anything else is a ConfigError naming --quant."""
    formats = [f.strip() for f in text.split(",") if f.strip()]
    if not formats or any(f not in QUANT_FORMATS for f in formats):
        raise ConfigError("quant", text, f"expected a comma-separated list of {', '.join(QUANT_FORMATS)}")
    return formats


def quant_tune(text: str) -> list:
    from engine.model.quant.kernels import QuantConfig

    return launch_shapes("quant_tune", text, QuantConfig)


def quantized_layer(weight: torch.Tensor, fmt: str):
    """A quantized layer of `weight` [N, K] (bf16, on the device) in `fmt`, as the loaders build them."""
    from engine.model.quant.linear import Fp8Linear, IntGroupLinear
    from engine.model.quant.rtn import int4_group_size, quantize_fp8, quantize_fp8_block, quantize_int4

    n, k = weight.shape
    if fmt == "fp8":
        q, scale = quantize_fp8(weight)
        return Fp8Linear(q, scale, (1, k))
    if fmt == "fp8-block":
        q, scale = quantize_fp8_block(weight, _GROUP)
        return Fp8Linear(q, scale, (_GROUP, _GROUP))
    if fmt in ("int4", "int4-g32"):
        group = 32 if fmt == "int4-g32" else int4_group_size(k)
        codes, scale, zero = quantize_int4(weight, group)
        return IntGroupLinear(codes, scale, -zero * scale, 4, group)
    # int8: symmetric codes shifted to unsigned, one scale per group (Q8_0's layout at group 32)
    group = 32 if fmt == "int8-g32" else next(g for g in (_GROUP, 64, 32, k) if k % g == 0)
    w = weight.float().view(n, k // group, group)
    scale = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-10)
    codes = (torch.round(w / scale[..., None]).clamp(-127, 127) + 128).view(n, k)
    return IntGroupLinear(codes, scale, -128.0 * scale, 8, group)


def _gemlite(layer, dtype: torch.dtype):
    """gemlite's layer for `layer` where the package is importable and knows the format, else None (its error is
    the row's `gemlite_error`)."""
    if importlib.util.find_spec("gemlite") is None:
        return None
    from gemlite import helper  # noqa: PLC0415 - optional, never a dependency

    w = layer.dequantize(dtype)
    device = str(w.device)
    if layer.format == "int4":
        # gemlite >= 0.6 takes 4-bit codes with a scale and zero per group (w = (u - zero) * scale): those of
        # the weight's own grid, group by group, at the layer's group size
        n, k = w.shape
        groups = w.float().view(n, k // layer.group_size, layer.group_size)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        zero = -low / scale
        codes = (groups / scale + zero).round().clamp(0, 15).to(torch.uint8).view(n, k)
        return helper.A16W4_HQQ_INT(device=device, dtype=dtype).from_weights(
            codes, scale.view(n, -1).to(dtype), zero.view(n, -1).to(dtype))
    # 8-bit weights, channel-wise, quantized by gemlite from the same weight: FP8 for the FP8 formats
    fp8 = torch.float8_e4m3fn if layer.format.startswith("fp8") else None
    return helper.A16W8(device=device, dtype=dtype, fp8=fp8).from_weights(w)


def quant_case(name: str, n: int, k: int, rows: int, fmt: str, device: torch.device, iters: int,
               tune: list) -> dict[str, Any]:
    """One row: a weight shape at a row count in one format, every path and peer against cuBLAS bf16."""
    from engine.model.quant import kernels, tinygemm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter computes in fp32
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    source = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
    first = quantized_layer(source, fmt)
    q_bytes = first.weight_bytes
    # prompt-chunk rows are compute-bound: one copy of the weight is as good as many, and far cheaper to make
    copies = 1 if rows > _TC_MAX_ROWS else max(1, min(iters, -(-_COLD_BYTES // q_bytes)))
    layers = [first] + [quantized_layer(torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02, fmt)
                        for _ in range(copies - 1)]
    bf16_copies = 1 if rows > _TC_MAX_ROWS else max(1, min(iters, -(-_COLD_BYTES // (n * k * 2))))
    weights = [first.dequantize(dtype)] + [torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
                                           for _ in range(bf16_copies - 1)]
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)

    def rotating(items: list, product: Callable[[Any], torch.Tensor]) -> Callable[[], Callable[[], torch.Tensor]]:
        def build() -> Callable[[], torch.Tensor]:
            calls = iter(range(10**9))
            return lambda: product(items[next(calls) % len(items)])
        return build

    launch = kernels.plan(first)
    row: dict[str, Any] = {"weight": name, "format": fmt, "n": n, "k": k, "rows": rows, "copies": len(layers),
                           "mib": round(q_bytes / 2**20, 2), "ideal": round(n * k * 2 / q_bytes, 3),
                           "path": kernels.path_of(first, rows), "gemv_config": launch.gemv.label(),
                           "tc_config": launch.tc.label(), "class": _layer_class(first),
                           "chunk_gemm": _chunk_gemm(first, device)}
    expected = F.linear(x, weights[0])  # cuBLAS on the dequantized weight: the error's reference
    shapes: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
        ("torch", rotating(weights, lambda w: F.linear(x, w))),
        ("quant", rotating(layers, lambda layer: kernels.quant_linear(x, layer)))]
    if rows <= kernels.GEMV_MAX_ROWS:
        shapes.append(("gemv", rotating(layers, lambda layer: kernels.quant_linear(x, layer, "gemv"))))
        shapes += [(f"g_{c.label()}", rotating(layers, lambda layer, c=c: kernels.quant_linear(x, layer, "gemv", c)))
                   for c in tune if c.unpack == "slots"]
    if 4 < rows <= _TC_MAX_ROWS or rows in (4, _DENSE_MIN_ROWS):
        shapes.append(("tc", rotating(layers, lambda layer: kernels.quant_linear(x, layer, "tc"))))
    if 4 < rows <= _TC_MAX_ROWS:
        shapes += [(f"t_{c.label()}", rotating(layers, lambda layer, c=c: kernels.quant_linear(x, layer, "tc", c)))
                   for c in tune if c.unpack == "slots" or kernels.takes_pairs(first, c)]
    if rows >= _DENSE_MIN_ROWS:
        shapes.append(("dense", rotating(layers, lambda layer: kernels.quant_linear(x, layer, "dense"))))
    if tinygemm.takes(first) and device.type == "cuda":
        timed = rotating(layers, lambda layer: kernels.quant_linear(x, layer, "tinygemm"))

        def packed_first() -> Callable[[], torch.Tensor]:
            for layer in layers:  # each copy's pack is made at its first product, which a graph capture cannot hold
                kernels.quant_linear(x, layer, "tinygemm")
            return timed()

        shapes.append(("tinygemm", packed_first))
    if fmt in ("int4", "int8") and device.type == "cuda":
        try:
            peer = _gemlite(first, dtype)
            if peer is not None:
                shapes.append(("gemlite", lambda: lambda: peer(x)))
        except Exception as exc:  # noqa: BLE001 - an optional peer that cannot run this shape is a result too
            row["gemlite_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    time_launch_shapes(row, shapes, iters, expected)
    scale = expected.float().abs().max().item()
    for key in [c for c in row if c.endswith("_max_err")]:
        row[key] = round(row[key] / scale, 5)
    if "quant_ms" in row:
        row["quant_tb_s"] = round(q_bytes / row["quant_ms"] / 1e9, 3)
        if "torch_ms" in row:
            row["speedup"] = round(row["torch_ms"] / row["quant_ms"], 3)
    del layers, weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _chunk_gemm(layer, device: torch.device) -> str:
    """What the prompt-chunk path runs for `layer` here: an FP8 GEMM (row-wise / block-scaled) or dequantize +
    cuBLAS bf16."""
    from engine.model.quant import dense

    if layer.format == "fp8" and dense.rowwise_takes(layer, device):
        return "fp8 row-wise"
    if layer.format == "fp8" and dense.blockwise_takes(layer, device):
        return "fp8 block-scaled"
    return "dequantize + bf16"


def _layer_class(layer) -> str:
    from engine.model.quant.launch_table import layer_format, shape_class

    return shape_class(layer_format(layer), layer.out_features, layer.in_features)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per format and row count: one layer's four products in bf16 (cuBLAS) and quantized, and their ratio."""
    summary: dict[str, Any] = {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        for count in sorted({r["rows"] for r in rows}):
            mine = [r for r in rows if r["format"] == fmt and r["rows"] == count and "quant_ms" in r
                    and "torch_ms" in r]
            if mine:
                bf16_us = 1e3 * sum(r["torch_ms"] for r in mine)
                quant_us = 1e3 * sum(r["quant_ms"] for r in mine)
                summary[f"layer_bf16_us_rows{count}"] = round(bf16_us, 2)
                summary[f"layer_{fmt}_us_rows{count}"] = round(quant_us, 2)
                summary[f"layer_{fmt}_speedup_rows{count}"] = round(bf16_us / quant_us, 3)
    return summary


def launch_table_of(rows: list[dict[str, Any]], device_name: str) -> dict[str, dict[str, Any]]:
    """The launch-table entries (engine.model.quant.launch_table) the rows measured, per weight class: each path's
    fastest shape (summed over the row counts measured), and the thresholds where the next path is faster."""
    from engine.model.quant.launch_table import ONE_PATH_ROWS

    entries: dict[str, dict[str, Any]] = {}
    for cls in dict.fromkeys(r["class"] for r in rows):
        mine = sorted((r for r in rows if r["class"] == cls), key=lambda r: r["rows"])
        entry: dict[str, Any] = {}
        gemv = _fastest_shape([r for r in mine if r["rows"] in range(1, 5)], "gemv", "g")
        if gemv is not None:
            entry["gemv"] = gemv
        tc, tc_rows = _tc_route([r for r in mine if r["rows"] in range(5, _TC_MAX_ROWS + 1)])
        if tc is not None:
            entry["tc"] = tc
        if tc_rows is not None:
            entry["tc_rows"] = tc_rows
        # The GEMV takes all of a decode step's 1-4 rows or none (launch_table: one path for 1-4 sequences): all
        # where its time summed over the row counts measured up to 4 is at most the tensor-core kernel's over the
        # same counts, which is its time at 4 rows at each (its 16-row tile reads the weight once: 1-3 rows cost
        # what 4 do).
        both = [r for r in mine if r["rows"] == 4 and "gemv_ms" in r and "tc_ms" in r]
        if both:
            few = [r for r in mine if r["rows"] <= 4 and "gemv_ms" in r]
            gemv_ms = sum(r["gemv_ms"] for r in few)
            entry["gemv_rows"] = ONE_PATH_ROWS if gemv_ms <= len(few) * both[0]["tc_ms"] else 0
        # tinygemm (int4) up to the last row count from 1 up where it beats the faster of the paths it replaces
        tiny = 0
        for r in mine:
            ours = min(r.get("gemv_ms", float("inf")), r.get("tc_ms", float("inf")))
            if r["rows"] > entry.get("tc_rows", _TC_MAX_ROWS) or r.get("tinygemm_ms", ours) >= ours:
                break
            tiny = r["rows"]
        if tiny >= ONE_PATH_ROWS:  # fewer would split a decode step's 1-4 sequences between two paths
            entry["tinygemm_rows"] = tiny
        entries[cls] = entry
    return entries


def _fastest_shape(measured: list[dict[str, Any]], path: str, prefix: str) -> str | None:
    """The launch shape of `path` with the least time summed over `measured` (rows of one class)."""
    times = _shape_times(measured, path, prefix)
    return min(times, key=lambda label: sum(times[label].values())) if times else None


def _tc_route(measured: list[dict[str, Any]]) -> tuple[str | None, int | None]:
    """The tensor-core shape and `tc_rows`, the most rows it takes before the dense path (dequantize + cuBLAS)
    does: of the shapes timed at every row count of `measured`, the one whose route costs least summed over those
    counts, the route being the shape up to the last count where it beats the dense path and the dense path past
    it. A shape fastest over every count can lose there: a tile that wins at 64-128 rows but not at 16 is no gain
    where the dense path takes 64 and up anyway. Without dense timings: the fastest shape, no `tc_rows`."""
    times = _shape_times(measured, "tc", "t")
    dense = {r["rows"]: r["dense_ms"] for r in measured if "dense_ms" in r}
    if not times or not dense:
        return _fastest_shape(measured, "tc", "t"), None

    def route(label: str) -> tuple[float, int]:
        mine = times[label]
        wins = [rows for rows, ms in mine.items() if rows in dense and ms <= dense[rows]]
        last = max(wins) if wins else min(dense) - 1
        return sum(ms if rows <= last or rows not in dense else dense[rows] for rows, ms in mine.items()), last

    best = min(times, key=lambda label: route(label)[0])
    return best, route(best)[1]


def _shape_times(measured: list[dict[str, Any]], path: str, prefix: str) -> dict[str, dict[int, float]]:
    """{shape: {rows: ms}} of `path`'s launch shapes timed at every row count of `measured` (rows of one class);
    a shape that failed (out of shared memory on this device, say), or was off by more than 2 %, at any of those
    row counts is no candidate: summed over fewer rows it would look the fastest."""
    times: dict[str, dict[int, float]] = {}
    for r in measured:
        best = {}
        if f"{path}_ms" in r:
            best[r[f"{path}_config"]] = r[f"{path}_ms"]
        for key, value in r.items():
            if key.startswith(f"{prefix}_") and key.endswith("_ms") and r.get(key[:-3] + "_max_err", 0) <= 0.02:
                best[key[len(prefix) + 1:-3]] = value
        for label, ms in best.items():
            times.setdefault(label, {})[r["rows"]] = ms
    return {label: mine for label, mine in times.items() if len(mine) == len(measured)}


def write_table(path: str, rows: list[dict[str, Any]], device_name: str) -> Path:
    """`--table-out`: the measured entries for `device_name`, beside the other devices' entries already in `path`
    (the committed table's, when it is given)."""
    out = Path(path)
    table = json.loads(out.read_text()) if out.is_file() else {"devices": {}}
    table.setdefault("devices", {})[device_name] = launch_table_of(rows, device_name)
    out.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return out
