"""FUSED_EPILOGUE: the q/k norm + RoPE kernel that writes the keys and values into the pool itself, and the skinny
matmul whose last program adds the residual and applies the next RMSNorm, against the kernels they replace (in
Triton's interpreter on CPU tensors, fp32: bf16 is checked on the GPU, test_fused_epilogue_gpu.py), an engine
running them against the reference's tokens, and the switch's start-up rules on a CPU engine."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.api import SamplingParams
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of
from tests.engine.exec.triton_interpreter import run_in_interpreter, run_kernels_on_cpu


def rope_kv_check() -> None:
    """qk_norm_rope_kv against qk_norm_rope + write_kv on the same inputs: q, the pools and the scales equal bit
    for bit (same arithmetic, fp32 and int8 pools), q/k norm on and off, a head size off the power of two, rows
    whose tokens land in shuffled blocks, and nothing written outside them."""
    from engine.model import triton_ops as ops
    from engine.model.attention.kv_site import KVSite
    from engine.model.attention.triton_kv_write import write_kv

    gen = torch.Generator().manual_seed(11)
    b, t, hq, hkv = 2, 3, 4, 2
    blocks = torch.tensor([[5, 5, 2], [0, 7, 7]])
    offsets = torch.tensor([[0, 3, 1], [2, 0, 3]])
    for d, storage, norm in ((64, "fp32", True), (64, "int8", True), (80, "int8", False), (64, "fp32", False)):
        # the fused projection's output, with a row stride past its heads (a view, as the layer hands it)
        qkv = torch.randn(b, t, hq + 2 * hkv + 1, d, generator=gen)[:, :, :hq + 2 * hkv]
        qkv[:, :, hq:hq + hkv] *= 30.0  # keys far from 1, so int8 scales matter
        qw = torch.randn(d, generator=gen) if norm else None
        kw = torch.randn(d, generator=gen) if norm else None
        angles = torch.rand(b, t, d, generator=gen) * 6.28
        cos, sin = angles.cos(), angles.sin()
        dt = torch.int8 if storage == "int8" else torch.float32

        def pools():
            data = [torch.zeros(hkv, 8, 4, d, dtype=dt) for _ in range(2)]
            scales = [torch.ones(hkv, 8, 4) for _ in range(2)] if storage == "int8" else [None, None]
            return data, scales

        want_pools, want_scales = pools()
        qk = ops.qk_norm_rope(qkv[:, :, :hq + hkv], hq, qw, kw, cos, sin, 1e-6)
        write_kv(*want_pools, *want_scales, qk[:, hq:], qkv[:, :, hq + hkv:].transpose(1, 2), blocks, offsets)
        got_pools, got_scales = pools()
        q = ops.qk_norm_rope_kv(qkv, hq, qw, kw, cos, sin, 1e-6, KVSite(*got_pools, *got_scales, blocks, offsets))
        what = f"D {d}, {storage}, q/k norm {norm}"
        assert q.is_contiguous() and torch.equal(q, qk[:, :hq]), f"q differs: {what}"
        for got, want, name in zip(got_pools + got_scales, want_pools + want_scales, ("k", "v", "k scale", "v scale")):
            if want is not None:
                assert torch.equal(got, want), f"the {name} pool differs: {what}"
        assert got_pools[0][:, 1].abs().sum() == 0, "a write landed in a block no row addresses"


def linear_norm_check() -> None:
    """linear_add_rms_norm's kernel against the skinny matmul then the add + norm kernel: the same normed rows and
    sums bit for bit, one row to more than one row tile, with bias, with and without split K (the epilogue after
    the last split's sum), an output off the power of two; every counter back at 0 after each launch; and None
    where the skinny matmul does not take the product."""
    import engine.model.triton_ops as ops
    from engine.model.triton_linear import LinearConfig, linear_add_rms_norm, skinny_linear, skinny_linear_add_rms_norm
    from engine.model.triton_linear import split_counters

    gen = torch.Generator().manual_seed(12)
    for rows in (1, 5, 20):
        for n, k in ((48, 96), (100, 300)):
            x = torch.randn(rows, 1, k, generator=gen)
            w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            residual, norm_w = torch.randn(rows, 1, n, generator=gen), torch.randn(n, generator=gen)
            for split in (1, 3):
                for bb in (None, bias):
                    cfg = LinearConfig(block_n=16, block_k=64, split_k=split)
                    want = ops.add_rms_norm(skinny_linear(x, w, bb, cfg), residual, norm_w, 1e-6)
                    got = skinny_linear_add_rms_norm(x, w, bb, residual, norm_w, 1e-6, cfg)
                    what = f"rows {rows}, [{n}, {k}], split {split}, bias {bb is not None}"
                    assert torch.equal(got[1], want[1]), f"the sums differ: {what}"
                    assert torch.equal(got[0], want[0]), f"the normed rows differ: {what}"
                    assert not split_counters(torch.device("cpu")).any(), f"a counter left set: {what}"
    x, w = torch.zeros(2, 2048), torch.zeros(1024, 2048)
    assert linear_add_rms_norm(x, w, None, torch.zeros(2, 1024), torch.ones(1024), 1e-6) is None, "fp32: torch's"
    wide = torch.zeros(2, 1024, dtype=torch.bfloat16)
    assert linear_add_rms_norm(wide, w.t().contiguous().bfloat16(), None, torch.zeros(2, 2048, dtype=torch.bfloat16),
                               torch.ones(2048, dtype=torch.bfloat16), 1e-6) is None, "a wide output: cuBLAS"


def test_the_q_k_norm_rope_kernel_that_writes_the_kv_pool_matches_rope_then_write_in_the_interpreter():
    run_in_interpreter("tests.engine.model.test_fused_epilogue", "rope_kv_check")


def test_the_skinny_matmul_with_its_add_and_norm_epilogue_matches_the_two_kernels_in_the_interpreter():
    run_in_interpreter("tests.engine.model.test_fused_epilogue", "linear_norm_check")


def engine_check(model: str, kv: str, mtp_depth: int) -> None:
    """A CPU engine running its kernels in the interpreter (as test_triton_ops.engine_check) with FUSED_EPILOGUE
    gives FUSED_OPS' greedy tokens, which are the reference's; every decoder layer (MTP blocks included) runs the
    epilogues and the cache hands out write sites. fp32 on CPU: the skinny matmul does not take fp32 products, so
    the projections' epilogue is checked by linear_norm_check, the KV write here."""
    prompts = random_prompts(2, seed=97, lengths=(70, 140))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = tokens_of(run_all(make_engine(Path(model), batch=2, kv=kv), prompts, params))
    run_kernels_on_cpu()
    extra = {"batch_mtp": True, "mtp_depth": mtp_depth} if mtp_depth else {}  # lossless: the plain tokens
    engine = make_engine(Path(model), batch=2, kv=kv, switches={"FUSED_EPILOGUE": True}, **extra)
    assert engine.mtp_on or not mtp_depth, engine.mtp_off_reason
    model_ = engine.runner.model
    blocks = list(model_.layers) + ([m.block for m in model_.mtp.layers] if model_.mtp is not None else [])
    assert engine.runner.board.enabled("FUSED_EPILOGUE"), engine.runner.board.states["FUSED_EPILOGUE"]
    assert all(block.epilogue and block.self_attn.writes_kv for block in blocks)
    assert tokens_of(run_all(engine, prompts, params)) == want


def test_an_engine_with_fused_epilogues_in_the_triton_interpreter_gives_the_reference_tokens(ckpt):
    for kv in ("bf16", "int8"):
        run_in_interpreter("tests.engine.model.test_fused_epilogue", "engine_check", str(ckpt), kv, 0)


def test_an_mtp_engine_with_fused_epilogues_in_the_triton_interpreter_gives_the_plain_tokens(ckpt):
    run_in_interpreter("tests.engine.model.test_fused_epilogue", "engine_check", str(ckpt), "int8", 2)


def test_fused_epilogue_is_unavailable_where_fused_ops_cannot_run_or_is_off(ckpt, monkeypatch):
    """On a CPU engine both switches are unavailable with the reason; with FUSED_OPS turned off (its kernels
    could run), FUSED_EPILOGUE asked for is off with the reason that it needs FUSED_OPS, and no layer runs it."""
    import engine.model.attention.backends as backends

    engine = make_engine(ckpt, batch=2, switches={"FUSED_EPILOGUE": True})
    state = engine.runner.board.states["FUSED_EPILOGUE"]
    assert state.unavailable and not state.enabled and "CUDA" in state.reason
    monkeypatch.setattr(backends, "triton_runs", lambda device: True)
    engine = make_engine(ckpt, batch=2, switches={"FUSED_OPS": False, "FUSED_EPILOGUE": True})
    state = engine.runner.board.states["FUSED_EPILOGUE"]
    assert state.unavailable and not state.enabled and "needs FUSED_OPS" in state.reason
    assert engine.runner.model.ops is None and not any(layer.epilogue for layer in engine.runner.model.layers)


def degrade_check(model: str) -> None:
    """FUSED_EPILOGUE whose start-up probe fails (a fault injected into its kernel's launch): degraded at start
    with that error and one WARNING, FUSED_OPS' kernels serve, the reference's tokens come back."""
    import engine.model.triton_ops as ops
    from engine.telemetry import EventBus

    prompts = random_prompts(2, seed=98, lengths=(30, 50))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = tokens_of(run_all(make_engine(Path(model), batch=2), prompts, params))
    run_kernels_on_cpu()

    def fails(*args, **kwargs):
        raise RuntimeError("injected: out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    ops.qk_norm_rope_kv = fails
    bus = EventBus(history=1000)
    engine = make_engine(Path(model), bus, batch=2, switches={"FUSED_EPILOGUE": True})
    state = engine.runner.board.states["FUSED_EPILOGUE"]
    assert state.degraded and not state.enabled and "Hardware limit: 232448" in state.reason, state
    assert engine.runner.board.enabled("FUSED_OPS") and engine.runner.model.ops is not None
    assert not any(layer.epilogue for layer in engine.runner.model.layers)
    warnings = [e for e in bus.history() if e.type == "warning" and "FUSED_EPILOGUE" in e.message]
    assert len(warnings) == 1 and "Hardware limit" in warnings[0].message, warnings
    assert tokens_of(run_all(engine, prompts, params)) == want


def test_fused_epilogue_whose_kernels_cannot_run_degrades_at_start_and_fused_ops_serve(ckpt):
    run_in_interpreter("tests.engine.model.test_fused_epilogue", "degrade_check", str(ckpt))
