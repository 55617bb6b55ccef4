"""PyTorch's own int4 kernel (tinygemm, `torch._weight_int4pack_mm`: TorchAO's int4 weight-only path) on an
int4 layer: the peer `bench linear --quant` times beside ours, and a backend the launch table can route a class
of int4 weights to where it measured faster.

    packed, scales_and_zeros = pack(layer, torch.bfloat16)   # tinygemm's own layout of the layer's codes
    y = tinygemm_linear(rows, layer)                         # rows [M, K] -> [M, N]

tinygemm computes `w = (q - 8) * scale + zero` with scale and zero in the activations' dtype, packed per group
as [K / G, N, 2]; ours is `w = q * scale + offset`, so zero = offset + 8 * scale (rounded to bf16, where our
scales are fp16: tinygemm's weights differ from the reference by that rounding). Its packing is opaque (a
tensor-core tile order), so a layer routed to it keeps its own codes too (the prompt chunks dequantize those):
the int4 bytes twice, the price of the route.
"""

from __future__ import annotations

import torch

GROUPS = (32, 64, 128, 256)


def takes(layer) -> bool:
    """Whether tinygemm can run the layer: int4, a group it knows, N a multiple of 8, K of 32 at least."""
    return (layer.format == "int4" and layer.group_size in GROUPS and layer.out_features % 8 == 0
            and layer.in_features % 32 == 0)


def _inner_k_tiles(k: int) -> int:
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def pack(layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(tinygemm's packed weight, its scales and zeros [K / G, N, 2] in `dtype`) on the layer's device."""
    if not takes(layer):
        raise ValueError(f"tinygemm takes int4 layers with a group of {GROUPS}, N % 8 == 0 and K % 32 == 0, not "
                         f"{layer.format} group {getattr(layer, 'group_size', None)} [{layer.out_features}, "
                         f"{layer.in_features}]")
    codes = layer.codes()
    tiles = _inner_k_tiles(layer.in_features)
    if codes.is_cuda:  # two codes a byte, the even input in the high nibble
        packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), tiles)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, tiles)
    scale = layer.scales.to(torch.float32)
    zero = layer.offsets.to(torch.float32) + 8 * scale
    return packed, torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous().to(dtype)


def packed(layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's pack for activations of `dtype`, made at the first call (eagerly: never inside a CUDA graph
    capture) and kept on the layer, where `pack_bytes` counts it."""
    key = ("_tinygemm", dtype)
    cached = layer.__dict__.get(key)
    if cached is None:
        if layer.scale_device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tinygemm's pack of a layer must be made before a CUDA graph capture (run one "
                               "product eagerly first, or kernels.prepare)")
        cached = layer.__dict__[key] = pack(layer, dtype)
    return cached


def pack_bytes(layer) -> int:
    """Bytes of the packs made of the layer (its own codes stay: the prompt chunks dequantize those)."""
    return sum(t.numel() * t.element_size() for key, pair in layer.__dict__.items()
               if isinstance(key, tuple) and key[0] == "_tinygemm" for t in pair)


def tinygemm_linear(rows: torch.Tensor, layer) -> torch.Tensor:
    """rows [M, K] (act-order columns already gathered) through tinygemm -> [M, N], on the layer's pack for the
    rows' dtype (`packed`)."""
    packed_weight, scales_and_zeros = packed(layer, rows.dtype)
    if rows.is_cuda:
        out = torch._weight_int4pack_mm(rows, packed_weight, layer.group_size, scales_and_zeros)
    else:
        out = torch._weight_int4pack_mm_for_cpu(rows, packed_weight, layer.group_size, scales_and_zeros)
    return out + layer.bias.to(out.dtype) if layer.bias is not None else out
