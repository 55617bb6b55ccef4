"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (CUDA, compute capability 9.0 up).

A decode step at a few rows is a chain of a few hundred short kernels, each reading the one before's output; in
a CUDA graph each still waits for the one before to drain before its programs launch. Launched with PDL, a
kernel's programs are placed while the one before finishes: each waits (griddepcontrol.wait) at its top until the
kernel before has completed and its writes are visible, then lets the next one launch (launch_dependents), so a
chain keeps one kernel ahead, never more. Nothing is read or written before the wait, so the kernels' results and
their order are what they are without it.

    enable(device)            # at engine start, before any capture: on where the device has it
    kernel[grid](..., **launch_kwargs())   # a kernel with a USE_GDC constexpr that calls `gdc_start(USE_GDC)`
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it (then nothing launches with PDL)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_on = False


def enable(device: torch.device | str) -> bool:
    """PDL on for the kernels launched from now on where `device` is a CUDA device of compute capability 9.0 or up
    (not in Triton's interpreter); STRATA_PDL=0 leaves it off (the A/B of `bench profile`)."""
    global _on
    device = torch.device(device)
    _on = (triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
           and not os.environ.get("TRITON_INTERPRET") and os.environ.get("STRATA_PDL", "1") != "0")
    return _on


def launch_kwargs() -> dict:
    """The launch options of a kernel that calls `gdc_start`: PDL and its wait, or nothing."""
    return {"USE_GDC": True, "launch_pdl": True} if _on else {}


if triton is not None:

    @triton.jit
    def gdc_start(USE_GDC: tl.constexpr):
        """A kernel's first statement: wait for the kernel before (its writes visible), then let the next launch."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
