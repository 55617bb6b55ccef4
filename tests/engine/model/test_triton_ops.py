"""FUSED_OPS: the Triton kernels of engine.model.triton_ops and the KV write kernel against the PyTorch ops they
replace, in Triton's interpreter on CPU tensors (fp32: the interpreter rounds bf16 by truncation, so bf16 is
checked on the GPU, tests/engine/model/test_triton_ops_gpu.py), and the switch on a CPU engine."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.api import SamplingParams
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of
from tests.engine.exec.triton_interpreter import run_in_interpreter, run_kernels_on_cpu


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 2e-6) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert got.shape == want.shape and err <= atol, f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}, err {err}"


def kernels_check() -> None:
    """Each kernel against the reference ops, fp32, with the shapes and strides the layers hand it: a hidden size
    off the power of two, q and k as a strided view of the fused qkv projection, no q/k norm (Llama, Qwen2),
    gate and up as the halves of the fused projection, int8 and fp32 KV through a shuffled block table."""
    from engine.exec.kv.cache import quantize_int8
    from engine.model import triton_ops as ops
    from engine.model.attention.triton_kv_write import write_kv
    from engine.model.config import ModelConfig
    from engine.model.layers import rms_normalize
    from engine.model.rope import RotaryEmbedding, apply_rope

    gen = torch.Generator().manual_seed(7)
    x, res = torch.randn(2, 3, 96, generator=gen), torch.randn(2, 3, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    normed, summed = ops.add_rms_norm(x, res, w, 1e-6)
    _close(summed, x + res, "the residual sum")
    _close(normed, w * rms_normalize(x + res, 1e-6), "add + rms_norm")
    alone, same = ops.add_rms_norm(x, None, w, 1e-6)
    assert same is x
    _close(alone, w * rms_normalize(x, 1e-6), "rms_norm without a residual")

    b, t, hq, hkv, d = 2, 3, 4, 2, 64
    qkv = torch.randn(b, t, hq + 2 * hkv, d, generator=gen)
    src = qkv[:, :, :hq + hkv]  # the layer's view: strided over the heads of v
    qw, kw = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    rotary = RotaryEmbedding(ModelConfig.from_hf({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": hq,
        "num_key_value_heads": hkv, "head_dim": d, "intermediate_size": 512, "vocab_size": 100,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192}))
    positions = torch.tensor([[5, 6, 7], [100, 101, 4000]])
    cos, sin = rotary(positions, torch.float32)
    weight = torch.cat([qw.expand(hq, d), kw.expand(hkv, d)])
    want = apply_rope((weight * rms_normalize(src, 1e-6)).transpose(1, 2), cos, sin)
    _close(ops.qk_norm_rope(src, hq, qw, kw, cos, sin, 1e-6), want, "q/k norm + RoPE")
    _close(ops.qk_norm_rope(src, hq, None, None, cos, sin, 0.0), apply_rope(src.transpose(1, 2), cos, sin),
           "RoPE without q/k norm")
    odd = torch.randn(1, 2, hq + hkv, 80, generator=gen)  # a head size off the power of two (Phi-style 80)
    angles = torch.rand(1, 2, 80, generator=gen) * 6.28
    c80, s80 = angles.cos(), angles.sin()
    w80 = torch.randn(80, generator=gen)
    want80 = apply_rope((w80 * rms_normalize(odd, 1e-6)).transpose(1, 2), c80, s80)
    _close(ops.qk_norm_rope(odd, hq, w80, w80, c80, s80, 1e-6), want80, "q/k norm + RoPE at D = 80")

    gate_up = torch.randn(2, 3, 2 * 1500, generator=gen)  # two column blocks, the second partial
    gate, up = gate_up.split(1500, dim=-1)
    _close(ops.silu_mul(gate, up), F.silu(gate) * up, "silu * up")

    blocks = torch.tensor([[5, 5, 2], [0, 7, 7]])
    offsets = torch.tensor([[0, 3, 1], [2, 0, 3]])
    for storage, d in (("fp32", 64), ("int8", 64), ("int8", 80)):
        k = torch.randn(b, hkv, t, d, generator=gen) * torch.tensor([1.0, 40.0]).view(1, 2, 1, 1)
        v = torch.randn(b, t, hkv, d, generator=gen).transpose(1, 2)  # the layer's v: a transposed view
        dt = torch.int8 if storage == "int8" else torch.float32
        pools = [torch.zeros(hkv, 8, 4, d, dtype=dt) for _ in range(2)]
        scales = [torch.ones(hkv, 8, 4) for _ in range(2)] if storage == "int8" else [None, None]
        write_kv(*pools, *scales, k, v, blocks, offsets)
        for pool, scale, data in zip(pools, scales, (k, v)):
            tok = data.permute(1, 0, 2, 3)  # [Hkv, B, T, D], as the reference writes it
            if storage == "int8":  # the kernel scales by fp32 1/127 as torch does on CUDA; CPU torch divides
                want_q, want_s = quantize_int8(tok)
                assert (pool[:, blocks, offsets].int() - want_q.int()).abs().max() <= 1, "int8 codes off"
                assert torch.allclose(scale[:, blocks, offsets], want_s, rtol=1e-6, atol=0), "scales off"
            else:
                assert torch.equal(pool[:, blocks, offsets], tok)
            untouched = torch.ones(8, 4, dtype=torch.bool)
            untouched[blocks, offsets] = False
            assert not pool[:, untouched].any(), "a write landed outside the rows' (block, offset)"


def rope_kv_check() -> None:
    """The norm + RoPE kernel that writes the KV pool (qk_norm_rope_kv, a serving forward's) against qk_norm_rope
    + write_kv on the same inputs: q, the pools and the scales equal bit for bit (same arithmetic, fp32 and int8
    pools), q/k norm on and off, a head size off the power of two, rows whose tokens land in shuffled blocks, and
    nothing written outside them."""
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


def rope_and_mtp_check() -> None:
    """The rotary tables' kernel against RotaryEmbedding (plain and YaRN-scaled, positions as a strided view of
    packed inputs, far into a long context), and the MTP head with FUSED_OPS (its norms and the block's last add
    in the kernels) against the head without, on strata-tiny's weights in fp32."""
    from engine.model import load_checkpoint
    from engine.model import triton_ops as ops
    from engine.model.config import ModelConfig
    from engine.model.rope import RotaryEmbedding

    packed = torch.tensor([[3, 0, 1, 2], [9, 131070, 131071, 262143]])
    for scaling in (None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}):
        rotary = RotaryEmbedding(ModelConfig.from_hf({
            "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
            "vocab_size": 100, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "rope_scaling": scaling}))
        assert (rotary.attention_scaling != 1.0) is (scaling is not None)
        want = rotary(packed[:, 1:], torch.float32)
        got = ops.rope_tables(packed[:, 1:], rotary.inv_freq, rotary.attention_scaling, torch.float32)
        for g, w, what in zip(got, want, ("cos", "sin_rot")):
            _close(g, w, f"{what}, rope scaling {scaling}")

    model = load_checkpoint(Path(__file__).resolve().parents[3] / "engine" / "models" / "strata-tiny",
                            dtype="float32", device="cpu").model
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(7).expand(2, -1)
    with torch.no_grad():
        hidden = model(ids, positions)
        want = model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None)
        model.use_fused_ops(True)
        assert model.rotary.ops is not None and model.mtp.layers[0].block.ops is not None
        got = model.mtp(hidden[:, :-1], ids[:, 1:], positions[:, :-1], None)
    _close(got, want, "the MTP head with FUSED_OPS", atol=1e-4)


def skinny_check() -> None:
    """The skinny matmul against F.linear, fp32: one row to more than one row tile, K off the loop step and split
    unevenly (the last split runs short), with and without bias, through its partial sums (the last split adds
    them and sets its counter back) and without; and which products FUSED_OPS hands it."""
    from engine.model.triton_linear import LinearConfig, skinny_linear, split_counters, takes

    gen = torch.Generator().manual_seed(8)
    for rows in (1, 5, 20):
        for n, k in ((48, 96), (100, 300)):
            x = torch.randn(rows, 1, k, generator=gen)  # [B, T, K], as the layers hand it
            w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            for split in (1, 3):
                for b in (None, bias):
                    got = skinny_linear(x, w, b, LinearConfig(block_n=16, block_k=64, split_k=split))
                    _close(got, F.linear(x, w, b), f"rows {rows}, [{n}, {k}], split {split}", atol=1e-4)
    assert not split_counters(torch.device("cpu")).any(), "a launch left a split counter set"
    narrow = torch.zeros(1024, 2048)
    assert not takes(torch.zeros(1, 2048), narrow), "fp32 keeps torch's IEEE matmul"
    assert takes(torch.zeros(6, 2048, dtype=torch.bfloat16), narrow.bfloat16())
    assert not takes(torch.zeros(6, 1024, dtype=torch.bfloat16), narrow.t().bfloat16()), "a wide output: cuBLAS"
    assert not takes(torch.zeros(65, 2048, dtype=torch.bfloat16), narrow.bfloat16()), "a prompt chunk: cuBLAS"


def test_the_fused_kernels_in_the_triton_interpreter_match_the_reference_ops():
    run_in_interpreter("tests.engine.model.test_triton_ops", "kernels_check")


def test_the_norm_rope_kernel_that_writes_the_kv_pool_matches_rope_then_write_in_the_interpreter():
    run_in_interpreter("tests.engine.model.test_triton_ops", "rope_kv_check")


def test_the_rotary_tables_and_the_mtp_head_in_the_triton_interpreter_match_the_reference():
    run_in_interpreter("tests.engine.model.test_triton_ops", "rope_and_mtp_check")


def test_the_skinny_matmul_in_the_triton_interpreter_matches_f_linear():
    run_in_interpreter("tests.engine.model.test_triton_ops", "skinny_check")


def engine_check(model: str, kv: str, mtp_depth: int = 0) -> None:
    """A CPU engine whose paged kernels and FUSED_OPS kernels run (in the interpreter: the device checks of
    kernel_backend and triton_runs are the only things bypassed) gives the reference engine's greedy tokens, with
    and without FUSED_OPS; with it, every layer and the KV cache run the kernels (the norm + RoPE kernel writing
    the keys and values). With `mtp_depth`, under batched MTP (lossless: the plain reference's tokens)."""
    prompts = random_prompts(2, seed=96, lengths=(70, 140))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reference = make_engine(Path(model), batch=2, kv=kv)
    assert reference.runner.model.ops is None and reference.runner.board.states["FUSED_OPS"].unavailable
    want = tokens_of(run_all(reference, prompts, params))
    run_kernels_on_cpu()
    mtp = {"batch_mtp": True, "mtp_depth": mtp_depth} if mtp_depth else {}
    for fused in (False, True):
        engine = make_engine(Path(model), batch=2, kv=kv, switches={"FUSED_OPS": fused}, **mtp)
        assert engine.mtp_on or not mtp_depth, engine.mtp_off_reason
        assert (engine.runner.model.ops is not None) is fused and (engine.runner.kv.write_kernel is not None) is fused
        assert tokens_of(run_all(engine, prompts, params)) == want, f"FUSED_OPS={fused}"


def test_an_engine_with_fused_ops_in_the_triton_interpreter_gives_the_reference_tokens(ckpt):
    for kv in ("bf16", "int8"):  # the KV storage (the model computes in fp32 on CPU)
        run_in_interpreter("tests.engine.model.test_triton_ops", "engine_check", str(ckpt), kv)


def test_an_mtp_engine_with_fused_ops_in_the_triton_interpreter_gives_the_plain_tokens(ckpt):
    run_in_interpreter("tests.engine.model.test_triton_ops", "engine_check", str(ckpt), "int8", 2)


def test_fused_ops_whose_kernels_cannot_run_degrade_at_start_and_the_engine_serves(ckpt, monkeypatch):
    """A device that passes the check but where the kernels fail (here: CPU tensors outside Triton's interpreter,
    or no Triton at all): the start-up launch fails, FUSED_OPS is degraded with that error and one WARNING, and the
    engine serves the reference's tokens with the PyTorch ops. No request meets the failure."""
    import engine.model.attention.backends as backends
    from engine.telemetry import EventBus

    prompts = random_prompts(2, seed=99, lengths=(20, 40))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = tokens_of(run_all(make_engine(ckpt, batch=2), prompts, params))
    monkeypatch.setattr(backends, "triton_runs", lambda device: True)
    bus = EventBus(history=1000)
    engine = make_engine(ckpt, bus, batch=2)
    state = engine.runner.board.states["FUSED_OPS"]
    assert state.degraded and not state.unavailable and not state.enabled and state.reason
    assert engine.runner.model.ops is None and engine.runner.kv.write_kernel is None
    warnings = [e for e in bus.history() if e.type == "warning" and "FUSED_OPS" in e.message]
    assert len(warnings) == 1 and state.reason in warnings[0].message, warnings
    assert tokens_of(run_all(engine, prompts, params)) == want
