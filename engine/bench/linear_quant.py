"""`strata-engine bench linear --quant fp8,fp8-block,int4`: a decode step's projections with quantized weights,
each layout's Triton kernel (engine.model.quant.kernels) against cuBLAS on the same shape in bf16.

Per weight of one decoder layer (qkv and gate/up fused, as FUSED_PROJ runs them; o; down), row count and format,
timed as `bench linear` times its rows (a CUDA graph of `--iters` products rotating through copies that fill
256 MiB, so each product reads its weight from HBM, not from the L2):
- `torch_ms`: F.linear on the bf16 weight (cuBLAS), the figure the quantized kernel must beat;
- `quant_ms`: the layout's kernel at its default launch shape (`config`), and each `--quant-tune` shape
  (`BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES`) as `t_<shape>_ms`;
- `scaled_mm_ms` (fp8 per channel, where torch._scaled_mm runs: Hopper): the activations quantized per row,
  then cuBLAS in FP8 (the prompt-chunk path), with its quantization kernels in the time;
- `quant_tb_s`: the layout's bytes (codes and scales) over `quant_ms`; `speedup` = torch_ms / quant_ms;
  `ideal` = bf16 bytes / the layout's bytes (the speedup a kernel at bf16's bandwidth would reach);
  `max_err`: the largest difference from the bf16 product of the dequantized weight, over its largest value.
Formats: fp8 (per channel: `--quantize fp8`, compressed-tensors FP8), fp8-block (Qwen's 128x128 blocks), int4
(group 128: `--quantize int4`, AWQ, GPTQ), int4-g32 (groups of 32: GGUF's Q4_0 / Q4_K, whose scales the kernel
expands per weight at the default step of 128, or per step at a `--quant-tune` step of 32), int8 (group 128).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.bench.attention_common import launch_shapes, time_launch_shapes
from engine.errors import ConfigError

QUANT_FORMATS = ("fp8", "fp8-block", "int4", "int4-g32", "int8")
_COLD_BYTES = 256 * 2**20  # copies of a weight rotate through this many bytes: over the L2 (50 MiB on an H200)
_GROUP = 128


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
    from engine.model.quant.linear import FP8_MAX, Fp8Linear, IntGroupLinear
    from engine.model.quant.rtn import quantize_fp8, quantize_int4

    n, k = weight.shape
    if fmt == "fp8":
        q, scale = quantize_fp8(weight)
        return Fp8Linear(q, scale, (1, k))
    if fmt == "fp8-block":
        blocks = weight.float().view(n // _GROUP, _GROUP, k // _GROUP, _GROUP)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(n, k).to(torch.float8_e4m3fn)
        return Fp8Linear(q, scale, (_GROUP, _GROUP))
    if fmt in ("int4", "int4-g32"):
        group = 32 if fmt == "int4-g32" else _GROUP
        codes, scale, zero = quantize_int4(weight, group)
        return IntGroupLinear(codes, scale, -zero * scale, 4, group)
    # int8: symmetric codes shifted to unsigned, one scale per group of 128
    w = weight.float().view(n, k // _GROUP, _GROUP)
    scale = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-10)
    codes = (torch.round(w / scale[..., None]).clamp(-127, 127) + 128).view(n, k)
    return IntGroupLinear(codes, scale, -128.0 * scale, 8, _GROUP)


def quant_case(name: str, n: int, k: int, rows: int, fmt: str, device: torch.device, iters: int,
               tune: list) -> dict[str, Any]:
    """One row: a weight shape at a row count in one format, its kernel against cuBLAS bf16."""
    from engine.model.quant.kernels import default_config, quant_linear, scaled_mm_linear, scaled_mm_takes

    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    source = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
    first = quantized_layer(source, fmt)
    q_bytes = first.weight_bytes
    copies = max(1, min(iters, -(-_COLD_BYTES // q_bytes)))
    layers = [first] + [quantized_layer(torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02, fmt)
                        for _ in range(copies - 1)]
    bf16_copies = max(1, min(iters, -(-_COLD_BYTES // (n * k * 2))))
    weights = [first.dequantize(dtype)] + [torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
                                           for _ in range(bf16_copies - 1)]
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)

    def rotating(items: list, product: Callable[[Any], torch.Tensor]) -> Callable[[], Callable[[], torch.Tensor]]:
        def build() -> Callable[[], torch.Tensor]:
            calls = iter(range(10**9))
            return lambda: product(items[next(calls) % len(items)])
        return build

    config = default_config(first)
    row: dict[str, Any] = {"weight": name, "format": fmt, "n": n, "k": k, "rows": rows, "copies": len(layers),
                           "mib": round(q_bytes / 2**20, 2), "ideal": round(n * k * 2 / q_bytes, 3),
                           "config": config.label()}
    expected = F.linear(x, weights[0])  # the bf16 product of the dequantized weight: the error's reference
    shapes: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
        ("torch", rotating(weights, lambda w: F.linear(x, w))),
        ("quant", rotating(layers, lambda layer: quant_linear(x, layer)))]
    shapes += [(f"t_{c.label()}", rotating(layers, lambda layer, c=c: quant_linear(x, layer, c))) for c in tune]
    if scaled_mm_takes(x, first):
        shapes.append(("scaled_mm", rotating(layers, lambda layer: scaled_mm_linear(x, layer))))
    time_launch_shapes(row, shapes, iters, expected)
    scale = expected.float().abs().max().item()
    for key in [c for c in row if c.endswith("_max_err")]:
        row[key] = round(row[key] / scale, 5)
    if "quant_ms" in row:
        row["quant_tb_s"] = round(q_bytes / row["quant_ms"] / 1e9, 3)
        if "torch_ms" in row:
            row["speedup"] = round(row["torch_ms"] / row["quant_ms"], 3)
    del layers, weights
    torch.cuda.empty_cache()
    return row


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
