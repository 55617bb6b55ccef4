"""FP8 block scales as cuBLAS's block-scaled GEMM reads them (torch's scaled_mm, BlockWise128x128): made once per
layer at load (engine.model.quant.linear), read by each prompt chunk's GEMM (engine.model.quant.dense)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def blockwise_scales(scale: torch.Tensor) -> torch.Tensor:
    """A [N/128, K/128] block-scale tensor as cuBLAS's BlockWise128x128 GEMM reads it: K's blocks padded to a
    multiple of 4, K-major underneath, seen as [K4, N/128]."""
    return F.pad(scale.float(), (0, -scale.shape[1] % 4)).contiguous().t()
