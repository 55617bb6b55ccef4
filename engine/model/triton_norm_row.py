"""One row's residual add + RMSNorm as Triton device code, shared by the kernels that end in it: FUSED_OPS' own
add + norm kernel (engine.model.triton_ops) and the skinny matmul's epilogue under FUSED_EPILOGUE
(engine.model.triton_linear), so both give a row the same arithmetic: the sum rounded to the storage dtype, the
mean square in fp32, the normalised value rounded, then the weight product rounded (as the PyTorch ops of
engine.model.layers round)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_row(x_row, res_row, w_ptr, out_row, sum_row, n_cols, eps, cols, ok,
                     HAS_RES: tl.constexpr, CG: tl.constexpr):
    """out_row = w * rms_normalize(x_row + res_row) and sum_row = x_row + res_row (HAS_RES), over `cols` < n_cols.
    CG: load x_row past L1 (other programs of the launch wrote it: the epilogue reads what they released)."""
    if CG:
        x = tl.load(x_row + cols, mask=ok, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(x_row + cols, mask=ok, other=0.0)
    if HAS_RES:
        res = tl.load(res_row + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(out_row.dtype.element_ty)  # the residual sum, rounded
        tl.store(sum_row + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv_rms).to(out_row.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row + cols, (w * normed).to(out_row.dtype.element_ty), mask=ok)
