"""engine.model.moe_kernels: every backend against the reference path's per-expert products (engine.model.moe),
routes to one slot shared by several tokens, more routes of a slot than a block holds, skipped routes left as
they were, padding-sized shapes; FP8 and 4-bit pools against their dequantized weights; the Triton kernels in
Triton's interpreter on CPU (fp32), on the GPU in bf16."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.model.moe import expert_mlp
from engine.model.moe_blocks import MoELaunch, default_launch, sorted_blocks
from engine.model.moe_kernels import routed_experts
from engine.model.moe_kernels_int4 import int4_block_kw
from engine.model.moe_quant import Fp8Experts, Int4Experts, int4_layout, round_int4
from engine.model.moe_route import slots_and_counts, top_k_route
from tests.engine.exec.triton_interpreter import run_in_interpreter
from tests.engine.model.sm90_compile import compile_for_sm90


def _case(N: int, k: int, S: int, H: int, I: int, seed: int, dtype=torch.float32, device="cpu", hot: int = 0):
    """x, gate_up, down, slots, weights; `hot` > 0 routes every token's first choice to slot 0..hot-1 (reuse)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=gen)
    gate_up = torch.randn(S, 2 * I, H, generator=gen) / H ** 0.5
    down = torch.randn(S, H, I, generator=gen) / I ** 0.5
    slots = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(N)])
    if hot:
        slots[:, 0] = torch.arange(N) % hot
        slots[:, 1:] = torch.where(slots[:, 1:] < hot, slots[:, 1:] + hot, slots[:, 1:]) % S
    weights = torch.softmax(torch.randn(N, k, generator=gen), dim=-1)
    return [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
            for t in (x, gate_up, down, slots, weights)]


def _reference(x, gate_up, down, slots, weights):
    """out[n, j] = weights[n, j] * expert_mlp(x[n]) one route at a time (skipped routes: NaN, to be ignored)."""
    N, k = slots.shape
    out = torch.full((N, k, x.shape[1]), float("nan"), dtype=x.dtype)
    for n in range(N):
        for j in range(k):
            s = int(slots[n, j])
            if s >= 0:
                out[n, j] = (expert_mlp(x[n:n + 1], gate_up[s], down[s])[0] * weights[n, j]).to(x.dtype)
    return out


def _check_backend(backend: str, N: int, k: int, S: int, H: int, I: int, seed: int, hot: int = 0,
                   skip_every: int = 0, launch: str | None = None) -> None:
    x, gate_up, down, slots, weights = _case(N, k, S, H, I, seed, hot=hot)
    if skip_every:
        slots.view(-1)[::skip_every] = -1  # another path's routes: left as they were
    poison = torch.full((N, k, H), 7.0)
    got = routed_experts(x, gate_up, down, slots, weights, out=poison.clone(), backend=backend,
                         launch=MoELaunch.parse(launch, N * k) if launch else None)
    want = _reference(x, gate_up, down, slots, weights)
    served = slots >= 0
    torch.testing.assert_close(got[served], want[served], rtol=1e-4, atol=1e-5)
    assert torch.equal(got[~served], poison[~served])


def _fp8_pools(gate_up: torch.Tensor, down: torch.Tensor):
    """Per-channel e4m3 pools and their scales (as `--quantize fp8` rounds a projection)."""
    def one(w):
        scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 448.0
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale.to(torch.float32)
    (q_gu, s_gu), (q_d, s_d) = one(gate_up), one(down)
    return q_gu, q_d, Fp8Experts(s_gu, s_d)


def _int4_pools(gate_up: torch.Tensor, down: torch.Tensor, gate_up_group: int, down_group: int,
                scale_dtype=torch.float32):
    """4-bit pools in kernel_pack's layout with a scale and offset per group (as `--quantize int4` rounds a
    projection), the last slot a zero miss slot as the expert cache's."""
    H, I = gate_up.shape[-1], down.shape[-1]
    q_gu, s_gu, o_gu = round_int4(gate_up, gate_up_group, scale_dtype)
    q_d, s_d, o_d = round_int4(down, down_group, scale_dtype)
    for t in (q_gu, s_gu, o_gu, q_d, s_d, o_d):
        t[-1].zero_()
    quant = Int4Experts(s_gu, o_gu, s_d, o_d, gate_up_group, down_group, int4_layout(H, gate_up_group),
                        int4_layout(I, down_group))
    return q_gu, q_d, quant


def _check_int4(backend: str, N: int, k: int, S: int, H: int, I: int, groups: tuple[int, int], seed: int,
                hot: int = 0, skip_every: int = 0, padding: int = 0, launch: str | None = None) -> None:
    """A 4-bit pool against the reference on its dequantized weights; skipped routes and `padding` trailing rows
    (every route skipped, as the cache's padding rows) left as they were, and the miss slot computing zeros."""
    x, gate_up, down, slots, weights = _case(N, k, S, H, I, seed, hot=hot)
    q_gu, q_d, quant = _int4_pools(gate_up, down, *groups)
    assert q_gu.dtype == torch.int32 and q_gu.shape == (S, 2 * I, H // 8) and q_d.shape == (S, H, I // 8)
    if skip_every:
        slots.view(-1)[::skip_every] = -1
    if padding:
        slots[-padding:] = -1
    slots[0, -1] = S - 1  # the miss slot: zero codes, scales and offsets add 0
    poison = torch.full((N, k, H), 7.0)
    got = routed_experts(x, q_gu, q_d, slots, weights, out=poison.clone(), backend=backend, quant=quant,
                         launch=MoELaunch.parse(launch, N * k) if launch else None)
    dq_gu, dq_d = quant.dequantize(q_gu, q_d, torch.float32)
    want = _reference(x, dq_gu, dq_d, slots, weights)
    served = slots >= 0
    torch.testing.assert_close(got[served], want[served], rtol=1e-4, atol=1e-5)
    assert torch.equal(got[~served], poison[~served])
    assert torch.equal(got[0, -1], torch.zeros(H))
    rounded = (dq_gu[0] - gate_up[0]).abs().max().item()
    assert 0 < rounded < 0.2 * gate_up[0].abs().max().item()  # rounded to 16 levels a group, not the same weights


def _check_fp8(backend: str, N: int, k: int, S: int, seed: int, launch: str | None = None) -> None:
    x, gate_up, down, slots, weights = _case(N, k, S, 64, 32, seed, hot=2)
    q_gu, q_d, scales = _fp8_pools(gate_up, down)
    got = routed_experts(x, q_gu, q_d, slots, weights, backend=backend, quant=scales,
                         launch=MoELaunch.parse(launch, N * k) if launch else None)
    dq_gu = q_gu.to(torch.float32) * scales.gate_up_scale[..., None]
    dq_d = q_d.to(torch.float32) * scales.down_scale[..., None]
    torch.testing.assert_close(got, _reference(x, dq_gu, dq_d, slots, weights), rtol=1e-4, atol=1e-5)


def _check_route(N: int, E: int, k: int, norm: bool, prior: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=gen)
    logits[0, 1] = logits[0, 3] = logits[0].max() + 1  # a tie at the top: the lower expert first
    args = (torch.randn(5, E, generator=gen), torch.randint(0, 1000, (N,), generator=gen), 64) if prior else ()
    w_t, ids_t = top_k_route(logits, k, norm, *args, backend="triton")
    w_ref, ids_ref = top_k_route(logits, k, norm, *args, backend="torch")
    assert torch.equal(ids_t, ids_ref), (ids_t, ids_ref)
    torch.testing.assert_close(w_t, w_ref, rtol=1e-5, atol=1e-7)
    if not prior:
        assert ids_t[0, :2].tolist() == [1, 3]


def _check_books(N: int, k: int, E: int, with_valid: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    table = torch.randint(0, 5, (E,), generator=gen)  # slot 4: the miss slot
    valid = (torch.rand(N, generator=gen) < 0.7) if with_valid else None
    got = [torch.zeros(E), torch.zeros(1)]
    want = [torch.zeros(E), torch.zeros(1)]
    slots = slots_and_counts(ids, table, 4, valid, *got, backend="triton")
    ref = slots_and_counts(ids, table, 4, valid, *want, backend="torch")
    assert torch.equal(slots, ref)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and want[1].item() > 0


def kernels_check(part: int) -> None:
    """In Triton's interpreter: the scan layout (few routes) and the sorted one (many), reuse across tokens, more
    routes of one slot than a block holds, skipped routes, odd sizes, and other launch shapes (part 0: 16-bit
    pools); FP8 pools, the router's tail and the cache's route books against their torch ops (part 1); 4-bit pools
    (parts 2-4). A process each: the whole took about 100 s on an idle core."""
    if part >= 2:
        int4_check(part - 2)
        return
    if part == 1:
        _check_fp8("triton", 6, 4, 9, seed=7)  # FP8 pools: the scale applied to each finished sum
        _check_fp8("triton", 150, 2, 6, seed=8)
        _check_fp8("triton", 6, 4, 9, seed=7, launch="16x32x64x64x4x5")
        _check_fp8("triton", 6, 4, 9, seed=7, launch="1x4x16x32x2x1")  # the GEMV, whole K steps
        _check_route(7, 24, 5, norm=True, prior=False, seed=0)  # E not a power of two
        _check_route(3, 16, 2, norm=False, prior=True, seed=1)
        _check_books(9, 3, 20, with_valid=False, seed=0)
        _check_books(300, 4, 20, with_valid=True, seed=1)  # several programs' atomics into the same counts
        return
    _check_backend("triton", 1, 4, 9, 64, 32, seed=0)  # batch 1: one route a block
    _check_backend("triton", 6, 4, 9, 64, 32, seed=1, hot=2)  # tokens sharing a slot share a block
    _check_backend("triton", 40, 2, 5, 64, 32, seed=2, hot=1)  # 40 routes of slot 0: three blocks of 16
    _check_backend("triton", 5, 3, 7, 48, 24, seed=3, skip_every=4)  # odd H / I, skipped routes
    _check_backend("triton", 150, 2, 6, 32, 16, seed=4, hot=3, skip_every=5)  # 300 routes: the sorted layout
    _check_backend("triton", 9, 3, 7, 64, 32, seed=5, launch="32x16x32x32x4x2")
    _check_backend("triton", 6, 4, 9, 64, 32, seed=1, hot=2, launch="16x32x64x64x4x5")  # the tensor cores' scan
    _check_backend("triton", 5, 3, 7, 48, 24, seed=3, skip_every=4, launch="1x4x16x16x2x1")  # GEMV: tails of K, N
    _check_backend("triton", 6, 4, 9, 64, 32, seed=1, hot=2, launch="1x4x16x32x2x1")  # GEMV: whole K steps
    _check_backend("triton", 150, 2, 6, 32, 16, seed=6, launch="16x16x16x16x4x2")


def _check_int4_cache_pool() -> None:
    """A real expert cache's 4-bit pool (`--quantize int4` on a Qwen3-MoE checkpoint, 5 of 16 experts a layer):
    routes through its table, misses reading the zero miss slot, the kernels against the torch backend."""
    import tempfile
    from pathlib import Path

    from engine.exec.experts.cache import ExpertCache
    from engine.model import load_checkpoint
    from engine.model.random_checkpoint import write_random_checkpoint
    from engine.telemetry import EventBus

    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(Path(tmp), size="moe-tiny")
        model = load_checkpoint(Path(tmp), dtype="float32", device="cpu", quantize="int4").model
    cache = ExpertCache(model, torch.device("cpu"), EventBus(), slots=5)
    cache.prefetch(0, [3, 8, 1, 12, 6])  # copied in from the store, in slots of the policy's choosing
    pool = cache.pools[0]
    assert isinstance(pool.quant, Int4Experts) and pool.gate_up.dtype == torch.int32
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(7, cache.blocks[0].gate.in_features, generator=gen)
    ids = torch.stack([torch.randperm(pool.num_experts, generator=gen)[:2] for _ in range(7)])
    weights = torch.softmax(torch.randn(7, 2, generator=gen), dim=-1)
    slots = pool.table[ids]
    assert (slots == pool.slots).any() and (slots < pool.slots).any()  # hits and misses
    got, want = (routed_experts(x, pool.gate_up, pool.down, slots, weights, backend=b, quant=pool.quant)
                 for b in ("triton", "torch"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not got[slots == pool.slots].any() and got[slots < pool.slots].abs().sum() > 0


def int4_check(piece: int) -> None:
    """The 4-bit kernels: batch 1, a decode batch sharing slots, over 256 routes (the sorted layout), skipped
    routes and padding rows, groups of a whole step, of part of one (several groups a step, runs of 2 words) and of
    all of K (piece 0); several steps along K, other launch shapes, a real cache's pool (piece 1); the GEMV stepping
    a word run at a time over K = 512 (piece 2: the interpreter's slowest, about 35 s)."""
    if piece == 0:
        _check_int4("triton", 1, 4, 9, 64, 32, (64, 32), seed=10)
        _check_int4("triton", 6, 4, 9, 64, 32, (64, 32), seed=11, hot=2, skip_every=5, padding=1)
        _check_int4("triton", 150, 2, 6, 64, 32, (32, 16), seed=12, hot=3, skip_every=7, padding=4)
        _check_int4("triton", 5, 3, 7, 256, 64, (64, 16), seed=13, skip_every=4)
    elif piece == 1:
        _check_int4("triton", 3, 2, 5, 512, 48, (128, 48), seed=14, launch="16x16x32x256x4x2")
        _check_int4("triton", 6, 4, 9, 64, 32, (64, 32), seed=11, hot=2, skip_every=5, padding=1,
                    launch="16x32x64x64x4x5")  # the tensor cores' scan layout
        _check_int4_cache_pool()
    else:
        _check_int4("triton", 3, 2, 5, 512, 48, (128, 48), seed=14, launch="1x4x8x32x2x1")  # GEMV: a word run a step


@pytest.mark.parametrize("part", [0, 1, 2, 3, 4])
def test_triton_kernels_in_the_interpreter(part):
    run_in_interpreter("tests.engine.model.test_moe_kernels", "kernels_check", part)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
@pytest.mark.parametrize("N,k,S,hot,skip", [(1, 4, 9, 0, 0), (6, 4, 9, 2, 0), (40, 2, 5, 1, 3), (150, 2, 6, 3, 5)])
def test_torch_backends_against_the_reference(backend, N, k, S, hot, skip):
    _check_backend(backend, N, k, S, 64, 32, seed=N, hot=hot, skip_every=skip)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_fp8_pools_through_the_torch_backends(backend):
    _check_fp8(backend, 6, 4, 9, seed=7)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_int4_pools_through_the_torch_backends(backend):
    _check_int4(backend, 6, 4, 9, 64, 32, (64, 32), seed=11, hot=2, skip_every=5, padding=1)


def test_int4_pools_dequantize_as_the_quantized_linear_layers_do():
    """The pool's 4-bit layout is IntGroupLinear's: an expert's projection rounded by `--quantize int4` and the
    same weights rounded into a pool dequantize to the same bits."""
    from engine.model.quant.rtn import int4_group_size, quantize_linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 48, 256, generator=gen).to(torch.bfloat16)
    group = int4_group_size(256)
    codes, scales, offsets = round_int4(w, group, torch.float16)
    quant = Int4Experts(scales, offsets, scales, offsets, group, group, int4_layout(256, group),
                        int4_layout(256, group))
    pool, _ = quant.dequantize(codes, codes, torch.bfloat16)
    for e in range(3):
        linear = torch.nn.Linear(256, 48, bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(w[e])
        layer = quantize_linear(linear, "int4", torch.float16)
        assert torch.equal(layer.qweight, codes[e]) and torch.equal(layer.scales, scales[e])
        assert torch.equal(pool[e], layer.dequantize(torch.bfloat16))


def test_sorted_blocks_cover_each_route_once_in_blocks_of_one_slot():
    slots = torch.tensor([3, 0, 3, -1, 3, 3, 0, 2, 3, -1])
    sorted_slots, routes, starts = sorted_blocks(slots, num_slots=4, block_m=2)
    R = slots.numel()
    assert sorted_slots.tolist()[:8] == [0, 0, 2, 3, 3, 3, 3, 3]
    assert routes.tolist()[:8] == [1, 6, 7, 0, 2, 4, 5, 8]  # stable: a slot's routes in route order
    used = [s for s in starts.tolist() if s < R]
    assert used == [0, 2, 3, 5, 7]  # slot 0 (2 routes), slot 2 (1), slot 3 (5 routes: blocks of 2, 2, 1)
    assert starts.numel() <= min(R, -(-R // 2) + 4)


def test_the_launch_shape_depends_on_the_route_count_only_and_bad_shapes_are_refused():
    assert default_launch(60) == default_launch(60) and default_launch(10).scan and not default_launch(2048).scan
    # a decode or verify step's routes take the GEMV whatever their count, so MTP's verify rows get the bits of
    # its decode rows; a prompt chunk's take the tensor cores
    assert default_launch(1).gemv and default_launch(256).gemv and default_launch(256, four_bit=True).gemv
    assert not default_launch(257).gemv and default_launch(10) == default_launch(250)
    assert MoELaunch.parse("1x8x16x256x4x2", 10).gemv and not MoELaunch.parse("16x32x64x64x4x5", 10).gemv
    with pytest.raises(ValueError, match="block_m=8"):
        MoELaunch(8, 32, 64, 64, 4, 4, scan=True)
    with pytest.raises(ValueError, match="block_k=24"):
        MoELaunch(16, 32, 64, 24, 4, 4, scan=True)
    with pytest.raises(ValueError, match="BLOCK_MxGATE_UP_N"):
        MoELaunch.parse("16x32", 10)


@pytest.mark.gpu
@pytest.mark.gpu_shared
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("N,k,hot", [(1, 10, 0), (6, 10, 0), (6, 10, 3), (25, 10, 4), (2048, 10, 0)])
def test_gpu_backends_against_the_reference_in_bf16(backend, N, k, hot):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    S, H, I = 65, 2048, 512
    x, gate_up, down, slots, weights = _case(N, k, S, H, I, seed=N + hot, dtype=torch.bfloat16, device="cuda",
                                             hot=hot)
    got = routed_experts(x, gate_up, down, slots, weights, backend=backend)
    # the reference in fp32 from the same bf16 inputs: bf16 rounding of the kernel's result is the only gap
    ref = torch.stack([torch.stack([
        (expert_mlp(x[n:n + 1].float(), gate_up[int(slots[n, j])].float(), down[int(slots[n, j])].float())[0]
         * weights[n, j].float()) for j in range(k)]) for n in range(min(N, 64))])
    err = (got[:ref.shape[0]].float() - ref).norm() / ref.norm()
    assert err < 2e-2, f"{backend}: relative error {err:.3g}"
    assert torch.isfinite(got).all()


@pytest.mark.gpu
@pytest.mark.gpu_shared
@pytest.mark.parametrize("N", [1, 6, 2048])
def test_gpu_fp8_pools_against_their_dequantized_weights(N):
    x, gate_up, down, slots, weights = _case(N, 10, 65, 2048, 512, seed=N, dtype=torch.bfloat16, device="cuda")
    q_gu, q_d, scales = _fp8_pools(gate_up.float(), down.float())
    got = routed_experts(x, q_gu, q_d, slots, weights, backend="triton", quant=scales)
    want = routed_experts(x, q_gu, q_d, slots, weights, backend="grouped_mm", quant=scales)  # dequantized first
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.gpu_shared
@pytest.mark.parametrize("N", [1, 6, 2048])
def test_gpu_int4_pools_against_their_dequantized_weights(N):
    """The seed model's shape (groups of 128, fp16 scales): the Triton kernels against the dequantized weights'
    grouped GEMM, and a route's bits the same whichever other routes of the step are served."""
    x, gate_up, down, slots, weights = _case(N, 10, 65, 2048, 512, seed=N, dtype=torch.bfloat16, device="cuda")
    q_gu, q_d, quant = _int4_pools(gate_up.float(), down.float(), 128, 128, torch.float16)
    assert q_gu.element_size() * q_gu.numel() * 4 == gate_up.element_size() * gate_up.numel()  # a quarter
    got = routed_experts(x, q_gu, q_d, slots, weights, backend="triton", quant=quant)
    want = routed_experts(x, q_gu, q_d, slots, weights, backend="grouped_mm", quant=quant)  # dequantized first
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, f"relative error {err:.3g}"
    alone = torch.where(torch.arange(N, device="cuda")[:, None] == 0, slots, -1)  # the same launch, one row served
    first = routed_experts(x, q_gu, q_d, alone, weights, backend="triton", quant=quant)
    assert torch.equal(first[0], got[0])


_ROUTES = {"slots_ptr": "*i64", "sorted_slots_ptr": "*i64", "sorted_routes_ptr": "*i64", "starts_ptr": "*i64",
           "R": "i32"}


def _compile_cases():
    from engine.model import moe_gemv, moe_kernels, moe_kernels_int4, moe_route

    gate_up = {"x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", **_ROUTES, "act_ptr": "*bf16", "H": "i32",
               "I": "i32", "TOP_K": "i32", "stride_xn": "i32", "stride_ws": "i32", "stride_wn": "i32",
               "stride_ss": "i32", "stride_ar": "i32"}
    down = {"act_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "rw_ptr": "*bf16", **_ROUTES,
            "y_ptr": "*bf16", "H": "i32", "I": "i32", "stride_ar": "i32", "stride_ws": "i32", "stride_wn": "i32",
            "stride_ss": "i32", "stride_yr": "i32"}
    cases = []
    scan = MoELaunch.parse("16x32x64x64x4x5", 10)  # the tensor cores' scan layout (`--moe-tune`'s alternative)
    for launch in (scan, default_launch(20480)):  # the scan and the sorted layout (prompt chunks)
        for scaled, weight in ((False, "*bf16"), (True, "*fp8e4nv")):
            common = dict(BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, SCAN=launch.scan,
                          SCAN_R=16 if launch.scan else 1, PRECISION="tf32", SCALED=scaled)
            for name, kernel, signature, block_n in (("gate_up", moe_kernels._gate_up_kernel, gate_up,
                                                      launch.gate_up_n),
                                                     ("down", moe_kernels._down_kernel, down, launch.down_n)):
                cases.append((f"{name} {launch.label()} {'fp8' if scaled else 'bf16'}", kernel,
                              {**signature, "w_ptr": weight}, launch.num_warps, launch.num_stages,
                              {**common, "BLOCK_N": block_n}))
    int4_gate_up = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", **_ROUTES,
                    "act_ptr": "*bf16", "I": "i32", "KW": "i32", "TOP_K": "i32", "stride_xn": "i32",
                    "stride_qs": "i32", "stride_qn": "i32", "stride_ss": "i32", "stride_sn": "i32", "stride_ar": "i32"}
    int4_down = {"act_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", "rw_ptr": "*bf16",
                 **_ROUTES, "y_ptr": "*bf16", "H": "i32", "KW": "i32", "stride_ar": "i32", "stride_qs": "i32",
                 "stride_qn": "i32", "stride_ss": "i32", "stride_sn": "i32", "stride_yr": "i32"}
    for launch in (scan, default_launch(20480)):  # the seed model's shape: groups of 128, runs of 4
        common = dict(BLOCK_M=launch.block_m, BLOCK_KW=int4_block_kw(launch), SCAN=launch.scan,
                      SCAN_R=16 if launch.scan else 1, PRECISION="tf32", GROUP=128, RUN=4)
        int4 = moe_kernels_int4
        for name, kernel, signature, block_n in (("gate_up", int4._gate_up_int4_kernel, int4_gate_up, launch.gate_up_n),
                                                 ("down", int4._down_int4_kernel, int4_down, launch.down_n)):
            cases.append((f"{name} {launch.label()} int4", kernel, signature, launch.num_warps, launch.num_stages,
                          {**common, "BLOCK_N": block_n}))
    # a decode or verify step: the GEMV, in each format
    gemv_gate_up = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "o_ptr": "*bf16", "slots_ptr": "*i64",
                    "act_ptr": "*bf16", "H": "i32", "I": "i32", "TOP_K": "i32", "stride_xn": "i32",
                    "stride_ws": "i32", "stride_wn": "i32", "stride_ss": "i32", "stride_sn": "i32", "stride_ar": "i32",
                    "magic": "i32"}
    gemv_down = {"act_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "o_ptr": "*bf16", "rw_ptr": "*bf16",
                 "slots_ptr": "*i64", "y_ptr": "*bf16", "H": "i32", "I": "i32", "stride_ar": "i32", "stride_ws": "i32",
                 "stride_wn": "i32", "stride_ss": "i32", "stride_sn": "i32", "stride_yr": "i32", "magic": "i32"}
    for fmt, label, pool in ((0, "bf16", {}), (1, "fp8", {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "o_ptr": "*fp32"}),
                             (2, "int4", {"w_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16"})):
        gemv = default_launch(10, four_bit=fmt == 2)
        for name, kernel, signature, block_n in (("gate_up", moe_gemv._gate_up_gemv_kernel, gemv_gate_up,
                                                  gemv.gate_up_n),
                                                 ("down", moe_gemv._down_gemv_kernel, gemv_down, gemv.down_n)):
            cases.append((f"{name} {gemv.label()} {label}", kernel, {**signature, **pool}, gemv.num_warps,
                          gemv.num_stages, dict(FMT=fmt, GROUP=128 if fmt == 2 else 1, RUN=4 if fmt == 2 else 1,
                                                BLOCK_N=block_n, BLOCK_K=gemv.block_k, EVEN_K=True)))
    cases.append(("route 512 experts top-10", moe_route._route_kernel, {
        "logits_ptr": "*bf16", "prior_ptr": "*fp32", "pos_ptr": "*i64", "w_ptr": "*bf16", "ids_ptr": "*i64",
        "E": "i32", "stride_l": "i32", "drift": "i32", "phases": "i32"}, 4, 1,
        dict(K=10, K_PAD=16, E_PAD=512, HAS_PRIOR=True, NORM=True)))
    cases.append(("route books", moe_route._books_kernel, {
        "ids_ptr": "*i64", "table_ptr": "*i64", "valid_ptr": "*i1", "slots_ptr": "*i64", "counts_ptr": "*fp32",
        "misses_ptr": "*fp32", "R": "i32", "K": "i32", "miss_slot": "i32"}, 4, 1, dict(HAS_VALID=True, BLOCK=256)))
    return cases


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("case", range(20))
def test_each_kernel_compiles_for_sm90_without_spilling(case, tmp_path):
    """The interpreter runs code the GPU compiler may refuse: each kernel at the launch shapes the engine uses,
    compiled for an H200 by Triton's own compiler; those of a decode or verify step (bound by the weights' bytes)
    without spilling. The prompt-chunk shape (64-row blocks at 4 warps, rows gathered by route) keeps a few
    registers on the stack; it runs at the share of its floor docs/BENCHMARKS.md gives."""
    cases = _compile_cases()
    assert len(cases) == 20
    label, kernel, signature, warps, stages, constants = cases[case]
    registers, stack, local, shared = compile_for_sm90(kernel, signature, constants, warps, stages, tmp_path,
                                                       unaligned=("R", "H", "I", "TOP_K", "E", "K", "KW", "miss_slot"))
    print(f"{label}: {registers} registers, {stack} bytes of stack, {shared} bytes of shared memory")
    assert local == 0, f"{label}: {local} bytes of local memory"
    if constants.get("SCAN", True):
        assert stack == 0, f"{label} spills: stack {stack}"
