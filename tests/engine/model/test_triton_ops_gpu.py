"""FUSED_OPS on the GPU (skipped without CUDA): the kernels against the PyTorch ops they replace in bf16 (where
the interpreter cannot check rounding), the skinny matmul against cuBLAS, the int8 KV write code for code (alone and
from the norm + RoPE kernel), and
whole engines with the switch on and off (greedy tokens identical in fp32, graphs on), and COMPILE over steps that
launch the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.exec.kv.cache import quantize_int8
from engine.model.layers import rms_normalize
from engine.model.rope import apply_rope
from engine.telemetry import EventBus
from tests.engine.engine_helpers import beside_others_reserve_mib, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _ulps_off(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(share of elements that differ, largest difference in units of the bf16 spacing at the value)."""
    diff = (got.float() - want.float()).abs()
    spacing = torch.finfo(BF16).eps * want.float().abs().clamp(min=torch.finfo(BF16).tiny)
    return (diff > 0).float().mean().item(), (diff / spacing).max().item()


@pytest.mark.gpu_shared
def test_fused_kernels_round_like_the_bf16_reference_ops():
    """The residual sum and SiLU * up are the reference's bit for bit; the normed outputs differ at most by one
    rounding step (the fp32 sum of squares in another order), in a small share of elements."""
    from engine.model import triton_ops as ops

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(6, 1, 1024, device="cuda", dtype=BF16, generator=gen)
    res = 4 * torch.randn(6, 1, 1024, device="cuda", dtype=BF16, generator=gen)
    w = torch.randn(1024, device="cuda", dtype=BF16, generator=gen)
    normed, summed = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    share, ulps = _ulps_off(normed, w * rms_normalize(x + res, 1e-6))
    assert share < 0.02 and ulps <= 2, (share, ulps)

    gate_up = torch.randn(6, 1, 2 * 3072, device="cuda", dtype=BF16, generator=gen)
    gate, up = gate_up.split(3072, dim=-1)
    share, ulps = _ulps_off(ops.silu_mul(gate, up), F.silu(gate) * up)
    assert share < 0.02 and ulps <= 2, (share, ulps)

    hq, hkv, d = 16, 8, 128
    qkv = torch.randn(6, 3, hq + 2 * hkv, d, device="cuda", dtype=BF16, generator=gen)
    src = qkv[:, :, :hq + hkv]
    qw = torch.randn(d, device="cuda", dtype=BF16, generator=gen)
    kw = torch.randn(d, device="cuda", dtype=BF16, generator=gen)
    angles = torch.rand(6, 3, d, device="cuda", generator=gen) * 6.28
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    weight = torch.cat([qw.expand(hq, d), kw.expand(hkv, d)])
    want = apply_rope((weight * rms_normalize(src, 1e-6)).transpose(1, 2), cos, sin)
    got = ops.qk_norm_rope(src, hq, qw, kw, cos, sin, 1e-6)
    # RoPE's sum cancels: a one-step difference in a normed input is many steps of a small output, so the bound is
    # on the scale of the rotated pair (|x| + |rolled x|), which a wrong angle, head or weight would pass many times
    normed = (weight * rms_normalize(src, 1e-6)).transpose(1, 2).float()
    scale = normed.abs() + torch.roll(normed, d // 2, dims=-1).abs()
    err = ((got.float() - want.float()).abs() / scale.clamp(min=1e-3)).max().item()
    assert err <= 4 * torch.finfo(BF16).eps, err


@pytest.mark.gpu_shared
def test_the_rotary_tables_kernel_gives_rotary_embeddings_tables_bit_for_bit():
    """FUSED_OPS' rotary tables (one kernel, CUDA's cosf / sinf) against RotaryEmbedding's ten kernels: the same
    bits in bf16 and fp32, plain and YaRN-scaled, for positions across a 256K context given as a strided view."""
    from engine.model import triton_ops as ops
    from engine.model.config import ModelConfig
    from engine.model.rope import RotaryEmbedding

    positions = torch.randint(0, 262144, (6, 7), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    positions[0] = torch.arange(7, device="cuda")
    view = torch.cat([positions[:, :1], positions], dim=1)[:, 1:]  # packed inputs' positions: a strided view
    for d in (64, 128):
        for scaling in (None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}):
            rotary = RotaryEmbedding(ModelConfig.from_hf({
                "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 1,
                "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": d, "intermediate_size": 3072,
                "vocab_size": 100, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
                "rope_scaling": scaling})).cuda()
            for dtype in (BF16, torch.float32):
                want = rotary(view, dtype)
                got = ops.rope_tables(view, rotary.inv_freq, rotary.attention_scaling, dtype)
                for g, w, what in zip(got, want, ("cos", "sin_rot")):
                    assert torch.equal(g, w), (d, scaling, dtype, what, (g.float() - w.float()).abs().max().item())


@pytest.mark.gpu_shared
def test_the_acceptance_kernel_gives_the_references_outputs_on_the_gpu():
    from engine.exec.mtp_accept import greedy_acceptance, greedy_acceptance_kernel
    from tests.engine.exec.test_mtp_accept import _batch

    for k in (1, 2, 3):
        for seed in range(4):
            batch = _batch(k, seed, "cuda")  # views of packed inputs, as on the CPU
            for w, g in zip(greedy_acceptance(**batch), greedy_acceptance_kernel(**batch)):
                assert torch.equal(g, w), (k, seed, g.tolist(), w.tolist())


@pytest.mark.gpu_shared
def test_the_skinny_matmul_rounds_like_cublas_and_a_row_does_not_depend_on_the_batch():
    """The narrow projections FUSED_OPS takes (o and down of the 0.6B shape) at decode and verify row counts, with
    and without bias: within one bf16 rounding step of the fp32 product (cuBLAS rounds the same fp32 sum once), and
    a row's output is bit for bit the same whether it is multiplied alone or among 16 rows (decode vs verify)."""
    from engine.model.triton_linear import linear, split_counters, takes

    gen = torch.Generator(device="cuda").manual_seed(6)
    for n, k in ((1024, 2048), (1024, 3072)):
        weight = torch.randn(n, k, device="cuda", dtype=BF16, generator=gen) * 0.02
        bias = torch.randn(n, device="cuda", dtype=BF16, generator=gen)
        for rows in (1, 6, 16, 40):
            x = torch.randn(rows, 1, k, device="cuda", dtype=BF16, generator=gen)
            assert takes(x, weight)
            for b in (None, bias):
                got = linear(x, weight, b)
                exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
                spacing = torch.finfo(BF16).eps * exact.abs().clamp(min=0.1)  # fp32 sums of ~k terms err ~1e-4
                assert ((got.float() - exact).abs() / spacing).max().item() <= 1.01, (n, k, rows)
        x = torch.randn(16, 1, k, device="cuda", dtype=BF16, generator=gen)
        assert torch.equal(linear(x[:1], weight), linear(x, weight)[:1])
        # the last split to finish adds the partial sums in split order: the same bits whichever finishes last
        assert all(torch.equal(linear(x, weight), linear(x, weight)) for _ in range(20))
        assert not split_counters(x.device).any(), "a launch left a split counter set"
        assert not takes(x, weight.t().contiguous())  # a wide output stays with cuBLAS
        assert not takes(torch.randn(65, k, device="cuda", dtype=BF16), weight)  # a prompt chunk too


@pytest.mark.gpu_shared
def test_the_int8_kv_write_kernel_stores_quantize_int8s_codes_and_scales():
    from engine.model.attention.triton_kv_write import write_kv

    gen = torch.Generator(device="cuda").manual_seed(4)
    b, hkv, t, d = 4, 8, 3, 128
    k = 5 * torch.randn(b, hkv, t, d, device="cuda", dtype=BF16, generator=gen)
    v = torch.randn(b, t, hkv, d, device="cuda", dtype=BF16, generator=gen).transpose(1, 2)
    flat = torch.randperm(64 * 16, device="cuda", generator=gen)[: b * t].view(b, t)
    blocks, offsets = flat // 16, flat % 16
    pools = [torch.zeros(hkv, 64, 16, d, dtype=torch.int8, device="cuda") for _ in range(2)]
    scales = [torch.ones(hkv, 64, 16, device="cuda") for _ in range(2)]
    write_kv(*pools, *scales, k, v, blocks, offsets)
    for pool, scale, data in zip(pools, scales, (k, v)):
        want_q, want_s = quantize_int8(data.permute(1, 0, 2, 3))
        assert torch.equal(pool[:, blocks, offsets], want_q)
        assert torch.equal(scale[:, blocks, offsets], want_s)


@pytest.mark.gpu_shared  # its engines keep to 4 GiB (beside_others_reserve_mib)
def test_engine_greedy_tokens_are_the_same_with_fused_ops_on_and_off(ckpt):
    """fp32 (the kernels' fp32 rounding is the reference's up to the sum order), graphs on, int8 KV (the write
    kernel's quantizing path; every other GPU engine test runs FUSED_OPS, on by default, with bf16 KV too), prompts
    over several chunks, between the steps: beside them, which rows a decode step batches depends on timing (as in
    the prefill kernel's engine test), and other tests run beside this one."""
    kv = "int8"
    prompts = random_prompts(2, seed=97, lengths=(300, 600))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for fused in (False, True):
        engine = Engine(EngineConfig(model=str(ckpt), device="cuda:0", dtype="float32", batch=2, context=2048, kv=kv,
                                     prefill_chunk_tokens=256, prefill_overlap="off", switches={"FUSED_OPS": fused},
                                     vram_reserve_mib=beside_others_reserve_mib()),
                        EventBus(history=100000), block_tokens=16)
        assert (engine.runner.model.ops is not None) is fused
        tokens[fused] = tokens_of(run_all(engine, prompts, params))
        engine.close()
    assert tokens[True] == tokens[False]


def int8_pools_past_two_to_the_31(hkv: int, page: int, d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Key and value int8 pools [Hkv, blocks, page, D] whose last head starts past 2**31 elements while the head
    stride stays below it, and their scales."""
    num_blocks = 2**31 // ((hkv - 1) * page * d) + 64
    pools = [torch.zeros(hkv, num_blocks, page, d, dtype=torch.int8, device="cuda") for _ in range(2)]
    scales = [torch.ones(hkv, num_blocks, page, device="cuda") for _ in range(2)]
    assert pools[0].stride(0) < 2**31 <= (hkv - 1) * pools[0].stride(0)
    return pools, scales


@pytest.mark.gpu_shared
def test_kernels_address_a_pool_past_two_to_the_31_elements():
    """An int8 pool [Hkv, blocks, 16, D] whose last head starts past 2**31 elements while its head stride is below
    (Triton passes it as a 32-bit int): SHARED_PREFIX puts the prefix-cache tier's blocks in the pool, on a full
    H200 an int8 pool passes that size, and h * the head stride would overflow 32 bits (an illegal memory access). The
    write kernel stores to, and the decode kernel reads from, the last head's last blocks."""
    from engine.model.attention.triton_kv_write import write_kv
    from engine.model.attention.triton_paged import paged_decode_attention

    hkv, hq, d, page = 8, 16, 128, 16
    pools, scales = int8_pools_past_two_to_the_31(hkv, page, d)
    num_blocks = pools[0].shape[1]
    tokens = 8 * page
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(1, hkv, tokens, d, device="cuda", dtype=BF16, generator=gen)
    v = torch.randn(1, hkv, tokens, d, device="cuda", dtype=BF16, generator=gen)
    table = torch.arange(num_blocks - 8, num_blocks, dtype=torch.int32, device="cuda").view(1, 8)
    positions = torch.arange(tokens, device="cuda").view(1, tokens)
    write_kv(*pools, *scales, k, v, table[0, positions // page].long(), positions % page)
    kq, ks = quantize_int8(k[0])
    assert torch.equal(pools[0][:, num_blocks - 8:].reshape(hkv, tokens, d), kq)
    assert torch.equal(scales[0][:, num_blocks - 8:].reshape(hkv, tokens), ks)
    q = torch.randn(1, hq, 1, d, device="cuda", dtype=BF16, generator=gen)
    last = torch.tensor([[tokens - 1]], device="cuda")
    out = paged_decode_attention(q, *pools, *scales, table, torch.zeros(1, dtype=torch.long, device="cuda"), last,
                                 tokens, tokens + 1)
    def dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [Hkv, tokens, D] -> [Hq, ...]
        return (codes.float() * scale.unsqueeze(-1)).repeat_interleave(hq // hkv, 0)

    kk, vv = dequantized(kq, ks), dequantized(*quantize_int8(v[0]))
    p = torch.softmax(torch.einsum("hd,htd->ht", q[0, :, 0].float(), kk) / d ** 0.5, dim=-1)
    want = torch.einsum("ht,htd->hd", p, vv)
    assert (out[0, :, 0].float() - want).abs().max().item() < 2e-2


@pytest.mark.gpu_shared
def test_the_rope_kernel_writing_the_pool_gives_rope_then_write_bit_for_bit_in_bf16():
    from engine.model import triton_ops as ops
    from engine.model.attention.kv_site import KVSite
    from engine.model.attention.triton_kv_write import write_kv

    gen = torch.Generator(device="cuda").manual_seed(21)
    b, t, hq, hkv, d = 6, 3, 16, 8, 128
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device="cuda", dtype=BF16, generator=gen)
    qw, kw = (torch.randn(d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    angles = torch.rand(b, t, d, device="cuda", generator=gen) * 6.28
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    blocks = torch.randperm(64, device="cuda", generator=gen)[:b * t].view(b, t)
    offsets = torch.randint(0, 16, (b, t), device="cuda", generator=gen)
    for kv_dtype in (BF16, torch.int8):
        def pools():
            data = [torch.zeros(hkv, 64, 16, d, dtype=kv_dtype, device="cuda") for _ in range(2)]
            scales = [torch.ones(hkv, 64, 16, device="cuda") for _ in range(2)] if kv_dtype == torch.int8 else [None] * 2
            return data + scales

        want = pools()
        qk = ops.qk_norm_rope(qkv[:, :, :hq + hkv], hq, qw, kw, cos, sin, 1e-6)
        write_kv(*want, qk[:, hq:], qkv[:, :, hq + hkv:].transpose(1, 2), blocks, offsets)
        got = pools()
        q = ops.qk_norm_rope_kv(qkv, hq, qw, kw, cos, sin, 1e-6, KVSite(*got, blocks, offsets))
        assert torch.equal(q, qk[:, :hq]), kv_dtype
        for g, w in zip(got, want):
            assert w is None or torch.equal(g, w), kv_dtype


@pytest.mark.gpu_shared
def test_the_rope_kernel_writes_a_pool_past_two_to_the_31_elements():
    """As test_triton_ops_gpu's test for write_kv: the last KV head of an int8 pool starts past 2**31 elements
    (j * the head stride would overflow 32 bits); its keys and values land there, quantized as write_kv does."""
    from engine.exec.kv.cache import quantize_int8
    from engine.model import triton_ops as ops
    from engine.model.attention.kv_site import KVSite

    hkv, hq, d, page = 8, 16, 128, 16
    pools, scales = int8_pools_past_two_to_the_31(hkv, page, d)
    num_blocks = pools[0].shape[1]
    tokens = 2 * page
    gen = torch.Generator(device="cuda").manual_seed(23)
    qkv = torch.randn(1, tokens, hq + 2 * hkv, d, device="cuda", dtype=BF16, generator=gen)
    ones = torch.ones(1, tokens, d, device="cuda", dtype=BF16)
    positions = torch.arange(tokens, device="cuda").view(1, tokens)
    blocks = num_blocks - 2 + positions // page
    ops.qk_norm_rope_kv(qkv, hq, None, None, ones, torch.zeros_like(ones), 0.0,
                        KVSite(*pools, *scales, blocks, positions % page))  # cos 1, sin 0: the keys as they came
    for pool, scale, heads in ((pools[0], scales[0], qkv[0, :, hq:hq + hkv]), (pools[1], scales[1], qkv[0, :, hq + hkv:])):
        want_q, want_s = quantize_int8(heads.transpose(0, 1))
        assert torch.equal(pool[:, num_blocks - 2:].reshape(hkv, tokens, d), want_q)
        assert torch.equal(scale[:, num_blocks - 2:].reshape(hkv, tokens), want_s)


@pytest.mark.gpu_shared  # its engines keep to 4 GiB (beside_others_reserve_mib); its compile is host work
def test_compile_compiles_steps_that_launch_the_fused_kernels(ckpt, tmp_path, monkeypatch):
    """COMPILE wraps step functions that now launch FUSED_OPS' Triton kernels (user kernels inside Dynamo's
    trace): it must compile them, not degrade, and give the uncompiled engine's greedy tokens (fp32)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prompts = random_prompts(1, seed=98, lengths=(40, 90))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for compiled in (False, True):
        engine = Engine(EngineConfig(model=str(ckpt), device="cuda:0", dtype="float32", batch=1, context=1024,
                                     switches={"COMPILE": compiled}, vram_reserve_mib=beside_others_reserve_mib()),
                        EventBus(history=100000), block_tokens=16)
        assert engine.runner.model.ops is not None
        tokens[compiled] = tokens_of(run_all(engine, prompts, params))
        state = engine.runner.board.states["COMPILE"]
        assert state.enabled is compiled and not state.degraded, state.reason
        engine.close()
    assert tokens[True] == tokens[False]
