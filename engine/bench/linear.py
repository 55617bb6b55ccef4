"""`strata-engine bench linear`: a decode step's projections, torch's matmul (cuBLAS) against the FUSED_OPS kernel.

For each weight of one decoder layer of a random model's shape (qkv and gate/up fused as FUSED_PROJ fuses them,
o, down) and the LM head, and each row count (1: batch-1 decode; 6; 18: six rows verifying two drafts): the
time of one product, replayed from a CUDA graph of `--iters` products (so launch overhead between graphs is not
what is timed, the gaps inside one are) that rotate through copies of the weight filling 256 MiB (a decode step
reads each weight once, from HBM: a product repeated on one weight would time the L2), as
- `torch`: F.linear (cuBLAS);
- `skinny`: engine.model.triton_linear at its default launch shape (`takes`: whether FUSED_OPS runs it there);
- each `--tune` shape (`BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES`).
`*_tb_s` is the weight's bytes over the time (the device copies at ~4.3 TB/s), `*_max_err` the largest
difference from torch's output. With `--quant fp8,fp8-block,int4` it times the quantized layouts' kernels against
cuBLAS bf16 and the libraries instead, every path side by side (engine.bench.linear_quant).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.bench.attention_common import launch_shapes, time_launch_shapes, timed_row
from engine.bench.common import device_of, emit, save_partial
from engine.bench.linear_quant import quant_case, quant_formats, quant_tune, write_table
from engine.bench.linear_quant import summarize as quant_summary
from engine.errors import ConfigError


def _weights(size: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each product of one layer of the random model `size`, and of its LM head."""
    from engine.model.random_checkpoint import SIZES

    if size not in SIZES:
        raise ConfigError("size", size, f"unknown random size; known: {', '.join(SIZES)}")
    s = SIZES[size]
    h, d, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    return {"qkv": ((s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d, h),
            "o": (h, s["num_attention_heads"] * d), "gate_up": (2 * inter, h), "down": (h, inter),
            "lm_head": (s["vocab_size"], h)}


_COLD_BYTES = 256 * 2**20  # copies of a weight rotate through this many bytes: over the L2 (50 MiB on an H200)


def _case(name: str, n: int, k: int, rows: int, device: torch.device, iters: int, tune: list) -> dict[str, Any]:
    from engine.model.triton_linear import default_config, skinny_linear, takes

    dtype = torch.bfloat16
    w_bytes = n * k * 2
    # In a decode step each weight is read once per step and the step's weights are far over the L2, so a timed
    # product must not find its weight cached by the one before: the calls rotate through copies.
    weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02
               for _ in range(max(1, min(iters, -(-_COLD_BYTES // w_bytes))))]
    x = torch.randn(rows, k, device=device, dtype=dtype)

    def rotating(product: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        calls = iter(range(10**9))
        return lambda: product(weights[next(calls) % len(weights)])

    def reference(weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    cfg = default_config(n, k)
    row: dict[str, Any] = {"weight": name, "n": n, "k": k, "rows": rows, "copies": len(weights),
                           "takes": takes(x, weights[0]),
                           "default": f"{cfg.block_n}x{cfg.block_k}x{cfg.split_k}x{cfg.num_warps}x{cfg.num_stages}"}
    expected = reference(weights[0])
    shapes: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
        ("torch", lambda: rotating(reference)),
        ("skinny", lambda: rotating(lambda w: skinny_linear(x, w)))]
    shapes += [(f"n{c.block_n}_k{c.block_k}_s{c.split_k}_w{c.num_warps}_st{c.num_stages}",
                lambda c=c: rotating(lambda w: skinny_linear(x, w, None, c))) for c in tune]
    time_launch_shapes(row, shapes, iters, expected)
    for key in [c for c in row if c.endswith("_ms")]:
        row[key.replace("_ms", "_tb_s")] = round(w_bytes / row[key] / 1e9, 3)
    if "torch_ms" in row and "skinny_ms" in row:
        row["skinny_speedup"] = round(row["torch_ms"] / row["skinny_ms"], 3)
    return row


def run(args: argparse.Namespace) -> int:
    from engine.model.triton_linear import LinearConfig

    formats = quant_formats(args.quant) if args.quant else []
    q_tune = quant_tune(args.quant_tune) if args.quant_tune else []
    if (q_tune or args.table_out) and not formats:
        raise ConfigError("quant_tune" if q_tune else "table_out", args.quant_tune or args.table_out,
                          "the quantized kernels' launch shapes need --quant")
    device = device_of(args.device)
    # The quantized kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1): the GPU script's
    # steps are tried on CPU at tiny sizes so, there, their figures are no speeds at all
    interpreted = formats and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError("device", str(device), "the kernel is CUDA-only (its CPU check is the interpreter test)")
    weights = _weights(args.size)
    if formats:  # the quantized kernels against cuBLAS bf16 (engine.bench.linear_quant)
        layer = {name: shape for name, shape in weights.items() if name != "lm_head"}  # the head stays bf16
        rows: list[dict[str, Any]] = []
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        for fmt in formats:
            for name, (n, k) in layer.items():
                for r in args.rows:
                    rows.append(timed_row(lambda: quant_case(name, n, k, r, fmt, device, args.iters, q_tune)))
                    save_partial(args, "linear", rows, device)
                    if args.table_out:  # after every row: a run stopped at its time limit leaves its table so far
                        write_table(args.table_out, rows, device_name)
        extra = {"table_out": str(write_table(args.table_out, rows, device_name))} if args.table_out else {}
        emit(args, "linear", rows, quant_summary(rows), device, extra=extra)
        return 0
    tune = launch_shapes("tune", args.tune, LinearConfig)
    rows = [timed_row(lambda: _case(name, n, k, r, device, args.iters, tune))
            for name, (n, k) in weights.items() for r in args.rows]
    summary: dict[str, Any] = {}
    for r_count in args.rows:  # one layer's four products: all through torch, and as FUSED_OPS runs them
        mine = [r for r in rows if r["rows"] == r_count and r["weight"] != "lm_head" and "skinny_ms" in r
                and "torch_ms" in r]
        if mine:
            summary[f"layer_torch_us_rows{r_count}"] = round(1e3 * sum(r["torch_ms"] for r in mine), 2)
            summary[f"layer_fused_ops_us_rows{r_count}"] = round(
                1e3 * sum(r["skinny_ms"] if r["takes"] else r["torch_ms"] for r in mine), 2)
    emit(args, "linear", rows, summary, device)
    return 0
