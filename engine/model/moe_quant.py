"""How a pool of routed experts is stored when it is not 16/32-bit: the one structure its callers pass along.

    quant = Int4Experts(gu_scales, gu_offsets, dn_scales, dn_offsets, gate_up_group=128, down_group=128, ...)
    y = routed_experts(x, gate_up_codes, down_codes, slots, weights, quant=quant)   # engine.model.moe_kernels
    w_gate_up, w_down = quant.at(s).dequantize(gate_up_codes[s], down_codes[s], torch.bfloat16)  # the reference

- `Fp8Experts`: the pools are e4m3 (`gate_up [S, 2I, H]`, `down [S, H, I]`) with one fp32 scale per output
  channel (`gate_up_scale [S, 2I]`, `down_scale [S, H]`), as engine.model.quant.linear.Fp8Linear with blocks of
  1 x K: `w = fp8 * scale`.
- `Int4Experts`: the pools are 4-bit codes in engine.model.quant.linear.kernel_pack's layout (int32 words,
  `gate_up [S, 2I, H / 8]`, `down [S, H, I / 8]`) with a scale and an offset per group of inputs (`[S, N, K /
  group]`, the layer's scale dtype), as engine.model.quant.linear.IntGroupLinear: `w = u * scale + offset`,
  computed in fp32 and rounded once to the activations' dtype. A run of `run` words lies in one group.

Every tensor's first dimension is the slot (or store row), so a pool, a store and one expert (`at(s)`) are the
same structure; `tensors()` and `rebuilt()` let the expert cache allocate, copy and move them without knowing
which format it holds. A slot whose scales (and offsets) are zero computes zeros: the cache's miss slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.model.quant.linear import kernel_pack, run_words
from engine.model.quant.rtn import quantize_int4

INT4_BITS = 4
CODES_PER_WORD = 32 // INT4_BITS


@dataclass(frozen=True)
class Fp8Experts:
    """Per-channel FP8 pools' scales: gate_up_scale [S, 2I], down_scale [S, H], fp32."""

    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.gate_up_scale, self.down_scale

    def rebuilt(self, tensors) -> "Fp8Experts":
        """The same format with other tensors (in `tensors()`'s order)."""
        return Fp8Experts(*tensors)

    def at(self, index) -> "Fp8Experts":
        """Slot (or store row) `index`'s share: every tensor indexed along its first dimension."""
        return self.rebuilt(t[index] for t in self.tensors())

    def dequantize(self, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of the same leading dimensions as the scales, in `dtype`."""
        return ((gate_up.to(torch.float32) * self.gate_up_scale[..., None]).to(dtype),
                (down.to(torch.float32) * self.down_scale[..., None]).to(dtype))


@dataclass(frozen=True)
class Int4Experts:
    """Group-quantized 4-bit pools' scales and offsets ([S, N, K / group] each) and their layout."""

    gate_up_scales: torch.Tensor  # [S, 2I, H / gate_up_group]
    gate_up_offsets: torch.Tensor
    down_scales: torch.Tensor  # [S, H, I / down_group]
    down_offsets: torch.Tensor
    gate_up_group: int
    down_group: int
    gate_up_run: int  # words of a run in kernel_pack's layout (engine.model.quant.linear.run_words)
    down_run: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.gate_up_scales, self.gate_up_offsets, self.down_scales, self.down_offsets

    def rebuilt(self, tensors) -> "Int4Experts":
        a, b, c, d = tensors
        return replace(self, gate_up_scales=a, gate_up_offsets=b, down_scales=c, down_offsets=d)

    def at(self, index) -> "Int4Experts":
        return self.rebuilt(t[index] for t in self.tensors())

    def dequantize(self, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up codes [..., 2I, H / 8], down codes [..., H, I / 8]) -> ([..., 2I, H], [..., H, I]) in `dtype`,
        as IntGroupLinear.dequantize computes each projection."""
        return (_dequantize(gate_up, self.gate_up_scales, self.gate_up_offsets, self.gate_up_group,
                            self.gate_up_run, dtype),
                _dequantize(down, self.down_scales, self.down_offsets, self.down_group, self.down_run, dtype))


ExpertQuant = Fp8Experts | Int4Experts


def quant_tensors(quant: ExpertQuant | None) -> tuple[torch.Tensor, ...]:
    """A format's tensors, none for a 16/32-bit pool."""
    return () if quant is None else quant.tensors()


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int, run: int,
                dtype: torch.dtype) -> torch.Tensor:
    """IntGroupLinear.dequantize's arithmetic (`u * scale`, then `+ offset`, in fp32, then `dtype`) on kernel_pack's
    words, unpacked a byte at a time: a word's bytes in memory order (little-endian) hold slots 2b and 2b + 1 in
    their low and high nibbles, and stacking the slots before each run's words lays the codes out in input order
    with no transposing copy (the CPU's torch backend dequantizes each routed expert every step)."""
    *lead, n, words = codes.shape
    k = words * CODES_PER_WORD
    b = codes.contiguous().view(torch.uint8).view(*lead, n, words // run, run, 4)
    slots = [part for byte in range(4) for part in (b[..., byte] & 15, b[..., byte] >> 4)]  # slot j: 2 * byte + nibble
    w = torch.stack(slots, dim=-2).view(*lead, n, k // group, group).to(torch.float32)
    w.mul_(scales.to(torch.float32)[..., None]).add_(offsets.to(torch.float32)[..., None])
    return w.view(*lead, n, k).to(dtype)


def int4_layout(k: int, group: int) -> int:
    """The run (words) of a projection with K inputs in groups of `group` (engine.model.quant.linear.run_words)."""
    return run_words(INT4_BITS, group, k)


def round_int4(w: torch.Tensor, group: int, scale_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (codes [..., N, K / 8] int32 in kernel_pack's layout, scales, offsets [..., N, K / group] in
    `scale_dtype`): each group rounded as `--quantize int4` rounds a projection (engine.model.quant.rtn.quantize_int4
    and IntGroupLinear's construction, offset = -zero * scale)."""
    *lead, n, k = w.shape
    codes, scale, zero = quantize_int4(w.reshape(-1, k), group)
    packed = kernel_pack(codes, INT4_BITS, int4_layout(k, group))
    groups = k // group
    return (packed.view(*lead, n, k // CODES_PER_WORD), scale.to(scale_dtype).view(*lead, n, groups),
            (-zero * scale).to(scale_dtype).view(*lead, n, groups))

