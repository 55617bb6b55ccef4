"""The device's matmul rate, measured once at start: what the default step token budget is sized by
(engine.core.step_budget, through engine.orchestration.engine_setup)."""

from __future__ import annotations

import time

import torch

# A product large enough that launch overhead is noise on a GPU (about 0.3 ms on an H100 in bf16), small enough
# to cost a CPU start only milliseconds: the rule's clamps make a CPU's figure matter little.
_CUDA_SIZE, _CPU_SIZE = 4096, 384
_CALLS = 5


def matmul_flop_s(device: torch.device, dtype: torch.dtype) -> float:
    """Floating-point operations a second of one square product in `dtype` on `device`, best of a few calls
    after a warm-up (the cuBLAS heuristics' first call is slower)."""
    n = _CUDA_SIZE if device.type == "cuda" else _CPU_SIZE
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best_s = float("inf")
    with torch.inference_mode():
        torch.matmul(a, b)
        for _ in range(_CALLS):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best_s = min(best_s, time.perf_counter() - t0)
    del a, b
    return 2.0 * n ** 3 / max(best_s, 1e-9)

