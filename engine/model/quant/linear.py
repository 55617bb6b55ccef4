"""The quantized linear layers: one module per internal weight layout, each a drop-in for nn.Linear.

    y = layer(x)                       # x [..., K] -> [..., N], bias added when present
    w = layer.dequantize(torch.bfloat16)   # [N, K]: the reference weight (tests, prefill, CPU)

Two layouts cover every format the loaders read (engine.model.quant.formats maps each file format onto one):

* `Fp8Linear` (format "fp8"): e4m3 weights [N, K] and an fp32 scale per (block_n x block_k) block,
  `w = fp8 * scale[n // block_n, k // block_k]`. Qwen's FP8 checkpoints are blocks of 128 x 128
  (`weight_scale_inv`); per-channel FP8 (compressed-tensors) is blocks of 1 x K, per-tensor N x K.
* `IntGroupLinear` (format "int4" or "int8"): unsigned codes u and, per group of `group_size` inputs along K, a
  scale and an offset: `w = u * scale + offset`. AWQ, GPTQ and compressed-tensors' zero points fold into the
  offset (`offset = -zero * scale`); GGUF's Q4_K (scale and min per 32), Q8_0 and Q6_K map onto it exactly.
  GPTQ's act-order checkpoints (a g_idx that is not k // group) are stored with their K columns sorted by group
  and `perm` gathers the input's columns in the same order.

The kernels' layout of the codes (`kernel_pack`, made here at construction, the one place any loader's codes
become it): int32 words along K, 8 four-bit or 4 eight-bit codes a word, in runs of `run` words (4 where the
group allows): slot j of word w of a run holds the code of input `run * j + w` of the run's 32 (16) inputs. A
thread that loads one run (16 bytes) then finds the inputs of each slot side by side, so its activations load
as short vectors too, and unpacking a slot is one mask (the kernels' 1-4 row path) or a shift and a mask (the
tensor-core path), never an interleave. A run lies in one group, so one scale covers a word. The checkpoint
layouts are unchanged: `codes()` unpacks, and the writer packs them again as its format wants.

On CPU the forward dequantizes and multiplies (the reference). On CUDA every row count runs through
engine.model.quant.kernels: a decode or verify step dequantizes in registers and streams the quantized bytes once
(a step is bound by weight bytes); a prompt chunk takes FP8 matmuls or one dequantizing kernel into cuBLAS.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.quant.block_scales import blockwise_scales

FP8_MAX = 448.0  # the largest finite e4m3 value
RUN_WORDS = (4, 2, 1)  # words of a run (16 bytes, one vector load), the longest the group and K allow


class QuantLinear(nn.Module):
    """What every quantized layout shares: sizes, an optional bias, the dispatch between kernel and reference."""

    quantized = True
    format = "?"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    @property
    def scale_device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (what a decode step streams)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from engine.model.quant import kernels  # Triton: imported only where a GPU runs the model

            return kernels.quant_linear(x, self)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize to x's dtype, then one matmul: the oracle, and the path of CPU runs and prompt chunks."""
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Fp8Linear(QuantLinear):
    """e4m3 weight [N, K] with one fp32 scale per block (block_n x block_k)."""

    format = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> None:
        n, k = weight.shape
        super().__init__(k, n, bias)
        self.block_n, self.block_k = int(block[0]), int(block[1])
        expected = (math.ceil(n / self.block_n), math.ceil(k / self.block_k))
        if tuple(scale.shape) != expected:
            raise ValueError(f"fp8 scale has shape {list(scale.shape)}, expected {list(expected)} for a weight "
                             f"{[n, k]} in blocks of {self.block_n}x{self.block_k}")
        self.register_buffer("weight", weight.to(torch.float8_e4m3fn).contiguous())
        self.register_buffer("weight_scale", scale.to(torch.float32).contiguous())
        if (self.block_n, self.block_k) == (128, 128):  # a prompt chunk's block-scaled FP8 GEMM reads them so
            self.register_buffer("weight_scale_blocks", blockwise_scales(self.weight_scale), persistent=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.weight.shape
        scale = self.weight_scale.repeat_interleave(self.block_n, 0)[:n].repeat_interleave(self.block_k, 1)[:, :k]
        return (self.weight.to(torch.float32) * scale).to(dtype)

    @staticmethod
    def concat(parts: list["Fp8Linear"]) -> "Fp8Linear | None":
        """Parts stacked along N (fused q/k/v, gate/up): their blocks must line up (same block shape, every
        part but the last a whole number of blocks tall), else None and the caller keeps them apart."""
        first = parts[0]
        if any((p.block_n, p.block_k, p.in_features) != (first.block_n, first.block_k, first.in_features)
               for p in parts) or any(p.out_features % p.block_n for p in parts[:-1]):
            return None
        bias = _concat_bias(parts)
        return Fp8Linear(torch.cat([p.weight for p in parts]), torch.cat([p.weight_scale for p in parts]),
                         (first.block_n, first.block_k), bias)


class IntGroupLinear(QuantLinear):
    """Unsigned 4- or 8-bit codes, `w = u * scale + offset` per group of `group_size` along K."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group_size: int,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16) -> None:
        """codes: unsigned values [N, K] (any integer dtype; packed here); scale, offset [N, K / group_size]."""
        n, k = codes.shape
        super().__init__(k, n, bias)
        if bits not in (4, 8):
            raise ValueError(f"bits={bits}: the integer layouts are 4- and 8-bit")
        if k % group_size:
            raise ValueError(f"in_features={k} is not a multiple of the group size {group_size}")
        if bits == 4 and k % 8:
            raise ValueError(f"in_features={k} is not a multiple of 8: 4-bit codes fill whole 32-bit words")
        if group_size != k and group_size % (32 // bits):
            raise ValueError(f"group_size={group_size}: {bits}-bit codes are packed {32 // bits} to a word, and a "
                             "word's codes share a group")
        if tuple(scale.shape) != (n, k // group_size) or scale.shape != offset.shape:
            raise ValueError(f"scale {list(scale.shape)} / offset {list(offset.shape)}, expected {[n, k // group_size]}")
        self.bits, self.group_size = bits, group_size
        self.format = f"int{bits}"
        self.run = run_words(bits, group_size, k)
        self.register_buffer("qweight", kernel_pack(codes, bits, self.run))
        self.register_buffer("scales", scale.to(scale_dtype).contiguous())
        self.register_buffer("offsets", offset.to(scale_dtype).contiguous())
        self.register_buffer("perm", perm.to(torch.int64).contiguous() if perm is not None else None)

    def codes(self) -> torch.Tensor:
        """The unsigned codes [N, K] as int32."""
        return kernel_unpack(self.qweight, self.bits, self.run, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group_size
        scale = self.scales.to(torch.float32).repeat_interleave(g, 1)
        offset = self.offsets.to(torch.float32).repeat_interleave(g, 1)
        return (self.codes().to(torch.float32) * scale + offset).to(dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def dequantize_unpermuted(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in the checkpoint's column order (act-order GPTQ stores it sorted by group)."""
        w = self.dequantize(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    @staticmethod
    def concat(parts: list["IntGroupLinear"]) -> "IntGroupLinear | None":
        first = parts[0]
        if any((p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features)
               for p in parts):
            return None
        perms = [p.perm for p in parts]
        if any((q is None) != (perms[0] is None) or (q is not None and not torch.equal(q, perms[0])) for q in perms):
            return None
        out = IntGroupLinear.__new__(IntGroupLinear)
        QuantLinear.__init__(out, first.in_features, sum(p.out_features for p in parts), _concat_bias(parts))
        out.bits, out.group_size, out.format, out.run = first.bits, first.group_size, first.format, first.run
        for name in ("qweight", "scales", "offsets"):
            out.register_buffer(name, torch.cat([getattr(p, name) for p in parts]).contiguous())
        out.register_buffer("perm", perms[0])
        return out


def _concat_bias(parts: list[QuantLinear]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, device=parts[0].scale_device)
                      for p in parts])


def run_words(bits: int, group: int, k: int) -> int:
    """Words of a run in the kernel layout: the most (4, 2, 1) whose codes lie in one group and divide K's words."""
    per_word = 32 // bits
    words = -(-k // per_word)
    return next(r for r in RUN_WORDS if words % r == 0 and (group == k or group % (r * per_word) == 0))


def kernel_pack(codes: torch.Tensor, bits: int, run: int) -> torch.Tensor:
    """Unsigned codes [N, K] -> int32 words [N, ceil(K / per_word)] in the kernels' layout (module docstring): K
    padded with zero codes to whole words, slot j of word w of each run of `run` words holding input run*j + w of
    the run, in bits [bits*j, bits*j + bits)."""
    per_word = 32 // bits
    n, k = codes.shape
    words = -(-k // per_word)
    c = codes.to(torch.int32)
    if words * per_word != k:
        c = torch.cat([c, c.new_zeros(n, words * per_word - k)], dim=1)
    c = c.view(n, words // run, per_word, run).transpose(2, 3)  # [N, runs, w, j]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=codes.device)
    return _or_reduce(c << shifts).view(n, words)


def kernel_unpack(packed: torch.Tensor, bits: int, run: int, k: int) -> torch.Tensor:
    """The inverse of kernel_pack: int32 codes [N, K]."""
    per_word = 32 // bits
    n, words = packed.shape
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    c = (packed.view(n, words // run, run, 1) >> shifts) & ((1 << bits) - 1)  # [N, runs, w, j]
    return c.transpose(2, 3).reshape(n, words * per_word)[:, :k]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] -> int32 [N, K / 8] (4-bit: code j of a word in bits 4j..) or uint8 [N, K] (8-bit):
    compressed-tensors' dense packing (the writer's)."""
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    n, k = codes.shape
    c = codes.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    return _or_reduce(c << shifts)


def _or_reduce(shifted: torch.Tensor) -> torch.Tensor:
    # the nibbles do not overlap, so their sum is their bitwise or; int64 then wrap keeps bit 31 (code 8..15 in
    # the last nibble) without a signed overflow
    total = shifted.to(torch.int64).sum(dim=-1)
    return torch.where(total >= 2**31, total - 2**32, total).to(torch.int32).contiguous()


Linear = nn.Linear | QuantLinear


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: parameters, the quantized layers' buffers (codes, scales) and the packs made
    of them for PyTorch's int4 kernel (engine.model.quant.tinygemm: the int4 bytes twice where it is routed)."""
    from engine.model.quant.tinygemm import pack_bytes

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.weight_bytes + pack_bytes(m) for m in model.modules() if isinstance(m, QuantLinear))


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear)


def concat_linears(parts: list[QuantLinear]) -> QuantLinear | None:
    """One quantized layer whose output is the parts' outputs side by side, or None when their layouts differ
    (the model then keeps them apart: FUSED_PROJ is an optimisation, never a requirement)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        return None
    return kinds.pop().concat(parts)
