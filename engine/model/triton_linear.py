"""The FUSED_OPS projection: y = x W^T (+ bias) for the few rows of a decode or verify step, in Triton.

    y = linear(x, weight, bias)   # x [..., K], weight [N, K] -> [..., N]

A decode step multiplies 1 to a few dozen rows by each weight: the product is a stream of the weight's bytes.
For a narrow output (N < K: attention's output projection and the MLP's down projection) cuBLAS picks split-K
kernels that reach a fraction of what it reaches on the wide ones (docs/BENCHMARKS.md, "A decode step's
projections", `strata-engine bench linear`); `linear` takes those products here and leaves the wide ones (qkv,
gate/up, the LM head), where cuBLAS measured as fast or faster, to torch. Each program streams a
[BLOCK_N, K / SPLIT] slab of the weight in BLOCK_K steps through the tensor cores with every row of the step in
one [BLOCK_M, BLOCK_K] tile; the splits write fp32 partial sums that the last split to finish adds in split
order and rounds once, so the result is deterministic, and a row's output does not depend on the other rows (the
summation order is fixed by N, K and the row tile, the same 16 rows up to 16): a verify step of a few rows
computes a token's projections exactly as a decode step does. Rows past MAX_ROWS (prompt chunks) and fp32 use
torch's matmul: a large product is what cuBLAS is tuned for, and fp32 keeps its IEEE results.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.model.pdl import gdc_start, launch_kwargs


MAX_ROWS = 64  # rows up to this take the kernel (a decode batch of 8 with an MTP verify of depth 2 is 24)
_MIN_BLOCK_M = 16  # the tensor cores' smallest row tile: fewer rows are padded (masked, never loaded)


@dataclass(frozen=True)
class LinearConfig:
    """Launch shape: output columns per program, K per loop step, K splits (1: no partial sums), warps, stages."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_start(USE_GDC)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    tile_ok = m_ok[:, None] & n_ok[None, :]
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn  # a weight can pass 2**31 elements (an LM head)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if SPLIT > 1:
        # Each split stores its fp32 partial sum; the last of the tile's splits to finish (the counter's acq_rel
        # add orders the others' stores before its loads) adds all of them in split order, so the sum is the
        # same whichever finishes last, then sets the counter back to 0 for the next launch (split_counters).
        # One kernel, where a separate reduction kernel would cost a launch and a gap in the step's graph.
        parts = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(parts + split * M * N, acc, mask=tile_ok)
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        tl.debug_barrier()  # every thread's stores before the one thread's release (release is cumulative)
        if tl.atomic_add(counter, 1) == SPLIT - 1:
            tl.debug_barrier()  # and every thread's loads after its acquire
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(parts + s * M * N, mask=tile_ok, other=0.0, cache_modifier=".cg")
            _store_out(acc, b_ptr, out_ptr, rm, rn, n_ok, tile_ok, stride_om, HAS_BIAS)
            tl.atomic_xchg(counter, 0)
    else:
        _store_out(acc, b_ptr, out_ptr, rm, rn, n_ok, tile_ok, stride_om, HAS_BIAS)


@triton.jit
def _store_out(acc, b_ptr, out_ptr, rm, rn, n_ok, tile_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


_COUNTERS = 1 << 16  # split counters per device: one per output tile of a launch (an LM head has ~10K)
# One counter array per lane: launches of one lane run one after the other (one stream), but a prompt chunk may
# run on a side stream beside the decoding slots' steps (engine.exec.chunk_stream), and two launches sharing
# counters at once would each see the other's splits finish. The lane is set only by the owner of the engine's
# streams (engine.exec.cuda_streams.Streams.on), which switches stream and lane together; a ContextVar carries it to
# the launches deep in the model.
COUNTER_LANES = ("steps", "chunks")
_lane: contextvars.ContextVar[str] = contextvars.ContextVar("strata_counter_lane", default="steps")
_counters: dict[tuple[torch.device, str], torch.Tensor] = {}


@contextlib.contextmanager
def counter_lane(lane: str) -> Iterator[None]:
    """Launches (and graph captures) inside use `lane`'s split counters: "chunks" for a prompt chunk beside the
    steps. Called by engine.exec.cuda_streams.Streams.on only (tests/engine/exec/test_streams.py holds that)."""
    if lane not in COUNTER_LANES:
        raise ValueError(f"unknown counter lane {lane!r} (expected one of {', '.join(COUNTER_LANES)})")
    token = _lane.set(lane)
    try:
        yield
    finally:
        _lane.reset(token)


def split_counters(device: torch.device | str, lane: str | None = None) -> torch.Tensor:
    """The device's split counters (int32, all 0 between launches: the last split of a tile sets its counter back,
    so the next launch, and the next replay of a captured graph, finds it at 0; launches on one stream run one
    after the other, so one array serves every launch of a lane: `counter_lane`, default the current one). Made on
    the first call, which must not be inside a CUDA graph capture (the buffer would live in the graph's pool):
    FUSED_OPS' start-up probe makes every lane's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, lane or _lane.get())
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the skinny matmul's split counters must exist before a CUDA graph capture "
                               "(FUSED_OPS' start-up probe, engine.model.triton_ops.launch_each_once, makes them)")
        _counters[key] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return _counters[key]


def default_config(n: int, k: int) -> LinearConfig:
    """The launch shape for an [n, k] weight: enough programs to keep every SM streaming (split K when the
    output is narrow), each a slab of at least a few loop steps."""
    block_n = 32 if n >= 4096 else 16
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 256 and k // (split * 2) >= 512:
        split *= 2
    return LinearConfig(block_n=block_n, block_k=256 if k // split >= 256 else 128, split_k=split)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the kernel (else torch's matmul): 16-bit floats, few rows, a narrow output."""
    n, k = weight.shape
    return x.dtype in (torch.bfloat16, torch.float16) and x.numel() // x.shape[-1] <= MAX_ROWS and n < k


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the kernel where it `takes` the product, torch's matmul otherwise."""
    return skinny_linear(x, weight, bias) if takes(x, weight) else F.linear(x, weight, bias)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LinearConfig | None = None) -> torch.Tensor:
    """The kernel itself, whatever the rows, shape and dtype (the tests run it on fp32 in Triton's interpreter,
    the bench at other launch shapes). x [..., K] with a contiguous last dim; weight [N, K] contiguous."""
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    assert rows.stride(1) == 1 and weight.is_contiguous() and rows.shape[1] == k, (tuple(x.shape), tuple(weight.shape))
    m = rows.shape[0]
    cfg = config or default_config(n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if cfg.split_k > 1 else out
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(m))  # every row in one tile: the weight is read once
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, block_m))
    counters = split_counters(x.device)
    assert grid[0] * grid[2] <= counters.numel(), (n, m, cfg)
    has_bias = bias is not None
    _skinny_kernel[grid](
        rows, weight, bias if has_bias else weight, out, part, counters, m, n, k, k_per_split,
        rows.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split_k, HAS_BIAS=has_bias,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(),
    )
    return out.view(*x.shape[:-1], n)
