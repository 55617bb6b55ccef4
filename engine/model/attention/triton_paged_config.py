"""Launch shape of the paged decode kernel (engine.model.attention.triton_paged), importable without Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the decode kernel: keys per tile (any multiple or divisor of the pool's block size),
    warps and pipeline stages. `bench attention --tune` times the alternatives."""

    tile_tokens: int = 128
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = KernelConfig()
