"""Weights into the L2 cache ahead of the product that reads them (CUDA, compute capability 9.0 up).

At a few rows a decode step's projections are short kernels: much of each one's time is the first bytes' trip
from device memory and the ramp to full bandwidth, and between them (norms, rotations, attention) the memory bus
sits idle. A kernel of the step can ask the L2 cache to fetch the weights of a product a few kernels ahead (one
bulk prefetch a thread, `cp.async.bulk.prefetch.L2`: a hint nothing waits for), so that product reads them from
L2. Weights do not change while a step runs, so the prefetch is issued at the kernel's very top, before its PDL
wait (engine.model.pdl), while the kernel before is still running; it reads nothing the step writes and changes
no result.

    enable(device)                            # at engine start: on where asked for and the device has it
    ranges, on = launch_args(tensors, anchor) # [ptr0, bytes0, ptr1, bytes1], and whether to prefetch
    kernel[grid](..., *ranges, PREFETCH=on)   # a kernel whose first statement is prefetch_l2(...)

Which products prefetch which weights is the model's plan (`plan_bytes` bounds it by the cache's size: a weight
larger than what L2 holds beside the one being read would push out its own first bytes before they are used).
Off unless STRATA_L2_PREFETCH=1: a decode step's speed with it is for `bench profile` to show (the A/B of
docs/MODEL.md, "Why these kernels") before it can be the default.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it (then nothing is prefetched)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

RANGES = 2  # byte ranges one launch prefetches
_ALIGN_BYTES = 16  # the bulk prefetch's address and size granule
_on = False
_l2_bytes = 0


def enable(device: torch.device | str) -> bool:
    """Prefetch on for the launches from now on where STRATA_L2_PREFETCH=1 and `device` is a CUDA device of compute
    capability 9.0 or up (not in Triton's interpreter, which runs no inline assembly)."""
    global _on, _l2_bytes
    device = torch.device(device)
    _on = (triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
           and not os.environ.get("TRITON_INTERPRET") and os.environ.get("STRATA_L2_PREFETCH", "0") == "1")
    _l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if _on else 0
    return _on


def plan_bytes() -> int:
    """The most bytes one launch may prefetch: half the L2 cache (the other half holds what the kernels between
    read), 0 while prefetching is off."""
    return _l2_bytes // 2 if _on else 0


def pick(tensors: list[torch.Tensor], budget_bytes: int) -> tuple[torch.Tensor, ...]:
    """The first of `tensors` (in the order the step reads them) whose bytes together fit `budget_bytes`, at most
    RANGES: a product whose weight does not fit stops the list (a later one would be read after it anyway), as
    does one that is not a single 16-byte-aligned span (what a bulk prefetch takes)."""
    chosen: list[torch.Tensor] = []
    total = 0
    for tensor in tensors[:RANGES]:
        size = tensor.numel() * tensor.element_size()
        if total + size > budget_bytes or not tensor.is_contiguous() or tensor.data_ptr() % _ALIGN_BYTES:
            break
        chosen.append(tensor)
        total += size
    return tuple(chosen)


def launch_args(tensors: tuple[torch.Tensor, ...], anchor: torch.Tensor) -> tuple[list, bool]:
    """([ptr0, bytes0, ptr1, bytes1], whether to prefetch) for a launch of a kernel that calls `prefetch_l2`: each
    range's bytes rounded down to the prefetch granule; a range not used (or prefetching off) is `anchor` with 0
    bytes (the launch needs a pointer there)."""
    on = _on and bool(tensors)
    args: list = []
    for i in range(RANGES):
        if on and i < len(tensors):
            args += [tensors[i], tensors[i].numel() * tensors[i].element_size() // _ALIGN_BYTES * _ALIGN_BYTES]
        else:
            args += [anchor, 0]
    return args, on


if triton is not None:

    @triton.jit
    def _prefetch_range(base_ptr, nbytes):
        """This program's share of [base, base + nbytes) (16-byte aligned), one chunk a thread."""
        nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
        share = tl.cdiv(tl.cdiv(nbytes, nprog), 16) * 16
        start = pid.to(tl.int64) * share
        mine = tl.minimum(tl.maximum(nbytes - start, 0), share).to(tl.int32)
        ptr = base_ptr.to(tl.pointer_type(tl.int8)) + start
        # thread t prefetches [t * c, (t + 1) * c) of the share, c = its even part over the block's threads
        # (%ntid.x), rounded up to 16 bytes and at least 2 KiB: fewer, larger requests where the share is small
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t, n, c, off, sz; .reg .u64 a;\n"
            "mov.u32 t, %tid.x; mov.u32 n, %ntid.x; add.u32 c, $2, n; sub.u32 c, c, 1; div.u32 c, c, n;\n"
            "add.u32 c, c, 15; and.b32 c, c, 0xFFFFFFF0; max.u32 c, c, 2048;\n"
            "mul.lo.u32 off, t, c; setp.lt.u32 p, off, $2; sub.u32 sz, $2, off; min.u32 sz, sz, c;\n"
            "cvt.u64.u32 a, off; add.u64 a, a, $1;\n"
            "@p cp.async.bulk.prefetch.L2.global [a], sz; mov.u32 $0, 0; }",
            "=r,l,r", [ptr, mine], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_l2(ptr0, bytes0, ptr1, bytes1, PREFETCH: tl.constexpr):
        """A kernel's first statement (before `gdc_start`): every program issues its share of both ranges."""
        if PREFETCH:
            _prefetch_range(ptr0, bytes0)
            _prefetch_range(ptr1, bytes1)
