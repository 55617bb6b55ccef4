"""`strata-engine bench experts --kernels 1,6,2048`: one sparse layer's routed experts per backend, at the model's
shape, against the bytes-read floor.

For each token count N (k routed experts a token, from the model's config): the time of one layer's expert
products for N tokens, replayed from a CUDA graph of `--iters` layers whose routings rotate over a pool of every
expert (a decode step reads each routed expert once, from HBM: one routing repeated would time the L2), as
- `triton`: engine.model.moe_kernels at its default launch shape for N x k routes, and each `--moe-tune` shape
  (`t<shape>`; a block of 1 route is the GEMV, engine.model.moe_gemv, 16 and up the tensor-core kernels);
- `grouped_mm`: torch._grouped_mm (CUTLASS grouped GEMM) over the routes sorted by slot;
- `gather` (N x k <= 256): the former captured path, each routed position's expert weights gathered into a new
  tensor, then bmm (kept as the baseline the fused kernels replace);
- `triton_fp8`: the Triton kernels on the same pools in e4m3 with per-channel scales (its floor: half the bytes);
- `triton_int4`: on the same pools as 4-bit codes with a scale and offset per group of 128, as `--quantize int4`
  rounds them (its floor: their bytes, about a quarter); each at the default launch and every `--moe-tune` shape
  (`triton_fp8_t<shape>`, `triton_int4_t<shape>`).
`floor_us` is the distinct experts' bytes over the device's measured copy bandwidth (`bench peers`' figure), and
`NAME_of_floor` the floor over each backend's time (1.0: at the bandwidth floor). The routings are drawn
uniformly, so N tokens share experts only by chance (a trained router's skew makes larger N cheaper).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.bench.attention_common import time_launch_shapes, timed_row
from engine.bench.common import emit
from engine.errors import ConfigError

_ROUTINGS = 16  # routings rotated over by the timed layers (each touches other experts of the pool)
_GATHER_MAX_ROUTES = 256  # the former captured path's own limit


def _gather(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    N, k = slots.shape
    y = torch.empty(N, k, x.shape[1], dtype=x.dtype, device=x.device)
    for j in range(k):
        h = torch.bmm(gate_up[slots[:, j]], x[:, :, None]).squeeze(-1)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)
        y[:, j] = torch.bmm(down[slots[:, j]], (F.silu(gate) * up)[..., None]).squeeze(-1)
    return y * weights[..., None]


def kernel_case(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, device: torch.device,
                iters: int, bandwidth_gb_s: float, tune: list[str], gate_up: torch.Tensor,
                down: torch.Tensor, quantized: dict[str, tuple] | None = None) -> dict[str, Any]:
    """`quantized`: {column: (gate_up, down, quant, bytes of an expert)}, the same pools in another format."""
    from engine.model.moe_blocks import MoELaunch, default_launch
    from engine.model.moe_kernels import routed_experts

    gen = torch.Generator(device="cpu").manual_seed(tokens)
    routings = [torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
                for _ in range(_ROUTINGS)]
    x = torch.randn(tokens, hidden, device=device, dtype=gate_up.dtype)
    weights = torch.softmax(torch.randn(tokens, top_k, device=device), dim=-1).to(gate_up.dtype)
    R = tokens * top_k
    distinct = sum(int(torch.unique(r).numel()) for r in routings) / len(routings)
    expert_bytes = 3 * hidden * inter * gate_up.element_size()
    row: dict[str, Any] = {"tokens": tokens, "routes": R, "distinct_experts": round(distinct, 1),
                           "default": default_launch(R).label(), "default_int4": default_launch(R, True).label(),
                           "floor_us": round(distinct * expert_bytes / (bandwidth_gb_s * 1e3), 2)}

    def rotating(product: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Callable[[], torch.Tensor]]:
        def build() -> Callable[[], torch.Tensor]:
            calls = iter(range(10**9))
            return lambda: product(routings[next(calls) % len(routings)])
        return build

    shapes: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
        ("triton", rotating(lambda s: routed_experts(x, gate_up, down, s, weights, backend="triton"))),
        ("grouped_mm", rotating(lambda s: routed_experts(x, gate_up, down, s, weights, backend="grouped_mm")))]
    if R <= _GATHER_MAX_ROUTES:
        shapes.append(("gather", rotating(lambda s: _gather(x, gate_up, down, s, weights))))
    launches = [MoELaunch.parse(text, R) for text in tune]
    byte_share = {}  # column -> its pool's bytes over the bf16 pool's (the floor scales with them)
    for launch in launches:
        shapes.append((f"t{launch.label()}", rotating(
            lambda s, launch=launch: routed_experts(x, gate_up, down, s, weights, backend="triton", launch=launch))))
    for name, (q_gu, q_d, quant, q_bytes) in (quantized or {}).items():  # the same pools quantized: fewer bytes
        # the default launch, then each --moe-tune shape on this pool too (`triton_fp8_t<shape>`)
        for column, launch in [(name, None)] + [(f"{name}_t{t.label()}", t) for t in launches]:
            byte_share[column] = q_bytes / expert_bytes
            shapes.append((column, rotating(lambda s, q_gu=q_gu, q_d=q_d, quant=quant, launch=launch: routed_experts(
                x, q_gu, q_d, s, weights, backend="triton", quant=quant, launch=launch))))
    expected = _gather(x, gate_up, down, routings[0], weights) if R <= _GATHER_MAX_ROUTES else \
        routed_experts(x, gate_up, down, routings[0], weights, backend="grouped_mm")
    time_launch_shapes(row, shapes, iters, expected)
    for key in [c for c in row if c.endswith("_ms")]:
        floor_us = row["floor_us"] * byte_share.get(key[:-3], 1.0)  # a quantized pool's own bytes
        row[key.replace("_ms", "_of_floor")] = round(floor_us / (row[key] * 1e3), 3)
    timed = {k[:-3]: v for k, v in row.items() if k.endswith("_ms")}
    if timed:
        row["best"] = min(timed, key=timed.get)
    return row


def _quantized_pools(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, tuple]:
    """The pools in e4m3 with one fp32 scale per output channel (as `--quantize fp8` rounds a projection), and as
    4-bit codes with an fp16 scale and offset per group (as `--quantize int4`), each with its bytes an expert."""
    from engine.model.moe_quant import Fp8Experts, Int4Experts, int4_layout, round_int4
    from engine.exec.experts.pool import int4_expert_bytes
    from engine.model.quant.rtn import int4_group_size

    def one(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.abs().amax(dim=-1).float().clamp(min=1e-12) / 448.0
        return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale

    (q_gu, s_gu), (q_d, s_d) = one(gate_up), one(down)
    H, I = gate_up.shape[-1], down.shape[-1]
    groups = int4_group_size(H), int4_group_size(I)

    def rounded(w: torch.Tensor, group: int) -> list[torch.Tensor]:
        # 64 experts at a time: the rounding makes fp32 and int64 copies of what it rounds, several times the
        # bf16 pool of a whole layer
        parts = [round_int4(w[i:i + 64], group, torch.float16) for i in range(0, w.shape[0], 64)]
        return [torch.cat(p) for p in zip(*parts)]

    c_gu, *gu = rounded(gate_up, groups[0])
    c_d, *dn = rounded(down, groups[1])
    int4 = Int4Experts(*gu, *dn, *groups, int4_layout(H, groups[0]), int4_layout(I, groups[1]))
    return {"triton_fp8": (q_gu, q_d, Fp8Experts(s_gu, s_d), 3 * H * I + 4 * (2 * I + H)),
            "triton_int4": (c_gu, c_d, int4, int4_expert_bytes(H, I, *groups, 2))}


def run_kernels(args: argparse.Namespace, config: Any, device: torch.device) -> int:
    from engine.bench.peers import copy_bandwidth_gb_s

    if device.type != "cuda":
        raise ConfigError("device", str(device), "the kernels are timed on CUDA (their CPU check is the "
                          "interpreter test, tests/engine/model/test_moe_kernels.py)")
    moe = config.moe
    tune = [t.strip() for t in (args.moe_tune or "").split(",") if t.strip()]
    H, I, E, k = config.hidden_size, moe.moe_intermediate_size, moe.num_experts, moe.num_experts_per_tok
    bandwidth = copy_bandwidth_gb_s(device, args.copy_mib)
    gen = torch.Generator(device=device).manual_seed(0)
    # one layer's pool: every expert plus the miss slot, as the expert cache holds it
    gate_up = torch.empty(E + 1, 2 * I, H, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    down = torch.empty(E + 1, H, I, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    quantized = _quantized_pools(gate_up, down)
    rows = [timed_row(lambda n=n: kernel_case(n, k, E, H, I, device, args.iters, bandwidth, tune, gate_up, down,
                                              quantized)) for n in args.kernels]
    summary = {"copy_bandwidth_gb_s": bandwidth, "hidden": H, "moe_intermediate": I, "num_experts": E, "top_k": k,
               "best": {r["tokens"]: r.get("best") for r in rows}}
    emit(args, "experts", rows, summary, device,
         ("tokens", "routes", "distinct_experts", "floor_us", "triton_ms", "triton_of_floor", "grouped_mm_ms",
          "grouped_mm_of_floor", "gather_ms", "gather_of_floor", "triton_fp8_ms", "triton_fp8_of_floor",
          "triton_int4_ms", "triton_int4_of_floor", "best"))
    return 0
