"""FUSED_EPILOGUE on the GPU (skipped without CUDA): its kernels against the FUSED_OPS kernels they replace, in bf16
(where the interpreter cannot check rounding) at the 0.6B shape's sizes, a pool past 2**31 elements, and whole
engines with the switch on and off: greedy tokens identical in bf16 with graphs on, at batch 1 and 6 and under MTP
(whose verify rows must compute a token as its decode step does)."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import beside_others_reserve_mib, random_prompts, run_all, tokens_of
from tests.engine.model.test_triton_ops_gpu import int8_pools_past_two_to_the_31

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


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


@pytest.mark.gpu_shared
@pytest.mark.parametrize("rows", [1, 6, 18, 64])
def test_the_skinny_matmul_with_its_norm_epilogue_gives_the_two_kernels_results_in_bf16(rows):
    """o (1024 x 2048) and down (1024 x 3072) of the 0.6B shape: the sums bit for bit; the normed rows the add +
    norm kernel's (the same row code at the same warps for a 1,024-wide row), reported by how many differ."""
    from engine.model import triton_ops as ops
    from engine.model.triton_linear import skinny_linear, skinny_linear_add_rms_norm, split_counters

    gen = torch.Generator(device="cuda").manual_seed(22)
    for k in (2048, 3072):
        x = torch.randn(rows, 1, k, device="cuda", dtype=BF16, generator=gen)
        w = torch.randn(1024, k, device="cuda", dtype=BF16, generator=gen) / k ** 0.5
        residual = 4 * torch.randn(rows, 1, 1024, device="cuda", dtype=BF16, generator=gen)
        norm_w = torch.randn(1024, device="cuda", dtype=BF16, generator=gen)
        want = ops.add_rms_norm(skinny_linear(x, w), residual, norm_w, 1e-6)
        got = skinny_linear_add_rms_norm(x, w, None, residual, norm_w, 1e-6)
        assert torch.equal(got[1], want[1]), (k, rows)
        differ = (got[0] != want[0]).sum().item()
        assert differ == 0, f"{differ} of {got[0].numel()} normed values differ (K {k}, {rows} rows)"
    assert not split_counters("cuda").any()


def _tokens(ckpt, epilogue: bool, batch: int, kv: str, mtp_depth: int = 0) -> list:
    prompts = random_prompts(batch, seed=131, lengths=(300, 600))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    mtp = {"batch_mtp": True, "mtp_depth": mtp_depth} if mtp_depth else {}
    engine = Engine(EngineConfig(model=str(ckpt), device="cuda:0", dtype="bfloat16", batch=batch, context=2048, kv=kv,
                                 prefill_chunk_tokens=256, prefill_overlap="off",
                                 switches={"FUSED_EPILOGUE": epilogue}, vram_reserve_mib=beside_others_reserve_mib(),
                                 **mtp),
                    EventBus(history=100000), block_tokens=16)
    try:
        layers = engine.runner.model.layers
        assert all(layer.epilogue is epilogue for layer in layers), engine.runner.board.states["FUSED_EPILOGUE"]
        assert engine.mtp_on or not mtp_depth, engine.mtp_off_reason
        return tokens_of(run_all(engine, prompts, params))
    finally:
        engine.close()


@pytest.mark.gpu_shared  # its engines keep to 4 GiB (beside_others_reserve_mib)
@pytest.mark.parametrize("batch, kv, mtp_depth", [(1, "bf16", 0), (6, "int8", 0), (6, "bf16", 2)])
def test_engine_greedy_tokens_are_the_same_with_fused_epilogue_on_and_off(ckpt, batch, kv, mtp_depth):
    """bf16 with graphs on: the epilogue kernels compute what the kernels they replace computed, so the tokens
    are equal, not merely close; under MTP each verify row is computed as its decode step computes it."""
    assert _tokens(ckpt, True, batch, kv, mtp_depth) == _tokens(ckpt, False, batch, kv, mtp_depth)
