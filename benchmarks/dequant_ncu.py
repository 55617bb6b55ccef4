"""The prompt-chunk path's int4 dequantizing kernel beside a copy of the bf16 bytes it writes, for Nsight Compute.

Two rounds of `dense.dequantize` then `out.copy_(w)` at one weight's shape (the 8B gate/up projection by
default), so `ncu -k "regex:dequant|copy" -c 4` sees each kernel twice, the second time warm:

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k "regex:dequant|copy" -c 4 \
        python3 benchmarks/dequant_ncu.py --device cuda:0
"""

from __future__ import annotations

import argparse

import torch

from engine.bench.linear_quant import QUANT_FORMATS, quantized_layer
from engine.model.quant import dense


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out-features", type=int, default=24576)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--format", default="int4", choices=QUANT_FORMATS, help="a bench linear --quant format")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    weight = torch.randn(args.out_features, args.in_features, device=device, dtype=torch.bfloat16) * 0.02
    layer = quantized_layer(weight, args.format)
    for _ in range(args.rounds):
        out = dense.dequantize(layer, torch.bfloat16)
        out.copy_(weight)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
