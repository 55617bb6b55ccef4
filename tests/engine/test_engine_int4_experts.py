"""INT4 experts (`--quantize int4` on a Qwen3-MoE checkpoint or a synthetic MoE): they stay 4-bit in the store and
in the cache's slots (int32 words of packed codes, a scale and an offset per group), an expert is about a quarter
of its 16-bit bytes, every budget and cold path gives the all-resident tokens, and the model follows its 16-bit
self. On CUDA (skipped without a GPU): the same across cache budgets under CUDA graphs, batch 1 and 6."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.bench.experts import cold_switches
from engine.exec.experts.pool import expert_bytes, int4_experts
from engine.model import load_checkpoint
from engine.model.moe_quant import Int4Experts
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

MODEL = "random:moe-synth-tiny"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=3, lengths=(12, 40))


def _pool_facts(cache) -> dict:
    """What the first sparse layer's pool holds (read before the engine closes and frees it)."""
    pool, block = cache.pools[0], cache.blocks[0]
    quant = getattr(pool, "quant", None)
    tensors = (pool.gate_up, pool.down, *(quant.tensors() if quant is not None else ()))
    return dict(H=block.gate.in_features, I=block.intermediate_size, slots=pool.slots,
                store_dtype=pool.store_gate_up.dtype, slot_dtype=pool.gate_up.dtype,
                gate_up_shape=tuple(pool.gate_up.shape[1:]), down_shape=tuple(pool.down.shape[1:]),
                int4=isinstance(quant, Int4Experts), scale_rows=quant.tensors()[0].shape[0] if quant else None,
                miss_slot_zero=all(not t[pool.slots].any() for t in tensors),
                slot_bytes=sum(t[0].numel() * t.element_size() for t in tensors),
                expert_bytes=cache.expert_mib * 2**20)


def _run(model, prompts, captured: bool = False, slots: int | None = None, batch: int = 3, **kw):
    with one_thread():
        engine = make_engine(model, batch=batch, quantize="int4", **kw)
        cache = engine.lm.model.expert_provider
        if slots is not None:
            cache.set_budget(cache.mib_for(slots), "test")
        if captured:
            cache.capturing = lambda x: True  # the graph-safe path, run eagerly
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            return tokens, dict(_pool_facts(cache), snap=cache.snapshot(),
                                weight_format=engine.state().to_json()["vram"][0]["weight_format"])
        finally:
            engine.close()


@pytest.fixture(scope="module")
def resident(prompts):
    return _run(MODEL, prompts)


def test_int4_experts_stay_int4_in_the_store_and_the_slots(resident):
    _, got = resident
    H, I = got["H"], got["I"]
    assert got["snap"].misses == 0 and got["weight_format"].startswith("int4")
    assert got["store_dtype"] == got["slot_dtype"] == torch.int32
    assert got["gate_up_shape"] == (2 * I, H // 8) and got["down_shape"] == (H, I // 8)
    assert got["int4"] and got["scale_rows"] == got["slots"] + 1
    assert got["miss_slot_zero"]  # zero codes, scales and offsets: the miss slot adds 0
    assert got["expert_bytes"] == got["slot_bytes"]
    assert got["expert_bytes"] < 0.3 * 3 * H * I * 4  # fp32 model: about an eighth (a quarter of bf16's)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("mode", ["copy", "cpu", "prefetch"])
def test_every_cold_path_gives_the_all_resident_int4_tokens(prompts, resident, mode, captured):
    tokens, got = _run(MODEL, prompts, captured, slots=4, switches=cold_switches(mode))
    snap = got["snap"]
    assert snap.misses > 0 and snap.slots == 4
    assert tokens == resident[0]


def test_the_int4_model_follows_its_16_bit_self():
    """The same seeded model in fp32 and with 4-bit projections and experts: next-token logits within the rounding
    of 16 levels a group, and the reference path reads the 4-bit store dequantized."""
    ids = torch.tensor([random_prompts(1, seed=9, lengths=(24, 25))[0]])
    logits = []
    for quantize in (None, "int4"):
        lm = load_checkpoint(MODEL, dtype="float32", device="cpu", quantize=quantize)
        block = lm.model.layers[0].mlp
        assert isinstance(block.expert_quant, Int4Experts) == (quantize == "int4")
        if quantize:
            assert block.expert_store[0].dtype == torch.int32 and int4_experts(block)
            assert expert_bytes(block) * 4 < 3 * block.gate.in_features * block.intermediate_size * 4
        with torch.no_grad():
            logits.append(lm.model(ids, positions=torch.arange(ids.shape[1])[None]).float())
    full, int4 = logits
    err = ((int4 - full).norm() / full.norm()).item()
    assert 1e-3 < err < 0.3, err  # rounded (not the same weights), but close


def test_a_checkpoint_quantized_to_int4_at_load_keeps_its_experts_int4_in_the_cache(tmp_path_factory):
    """`--quantize int4` on a Qwen3-MoE checkpoint: each expert's projections become 4-bit group-quantized
    modules, and the cache keeps their packed codes, scales and offsets (not a dequantized copy); a small budget
    gives the all-resident tokens, and the bytes it counts an expert are the ones a slot holds."""
    from tests.engine.engine_helpers import shared_lively_checkpoint

    ckpt = shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")
    prompts = random_prompts(2, seed=6, lengths=(12, 30))
    runs = []
    for slots in (None, 3):
        tokens, got = _run(ckpt, prompts, slots=slots, batch=2)
        assert got["store_dtype"] == got["slot_dtype"] == torch.int32 and got["int4"]
        assert got["expert_bytes"] == got["slot_bytes"] and got["miss_slot_zero"]
        runs.append((tokens, got["snap"].misses))
    (resident, no_misses), (small, misses) = runs
    assert no_misses == 0 and misses > 0
    assert small == resident


def test_act_order_experts_are_held_dequantized_in_the_checkpoints_column_order(tmp_path_factory):
    """GPTQ's act-order layers store K sorted by group and permute their inputs: not the pool's layout, so such
    experts stay dequantized, and in the checkpoint's column order (what the unpermuted activations multiply)."""
    from engine.exec.experts.pool import ExpertPool
    from engine.model.moe import sparse_blocks
    from tests.engine.engine_helpers import shared_lively_checkpoint

    ckpt = shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")
    block = sparse_blocks(load_checkpoint(ckpt, dtype="float32", device="cpu", quantize="int4").model)[0]
    assert int4_experts(block)
    proj = block.experts[1].down_proj
    proj.register_buffer("perm", torch.randperm(proj.in_features, generator=torch.Generator().manual_seed(0)))
    assert not int4_experts(block)
    pool = ExpertPool(block, torch.device("cpu"), torch.device("cpu"), pin=False)
    assert pool.store_gate_up.dtype == torch.float32 and getattr(pool, "store_quant", None) is None
    x = torch.randn(3, proj.in_features, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(x @ pool.host_weights(1, torch.float32)[1].T, proj(x))


def test_int4_at_load_keeps_a_projection_of_inputs_not_a_multiple_of_8_as_loaded(tmp_path):
    """A down projection of 60 inputs cannot be 4-bit codes in whole 32-bit words: `--quantize int4` refused the
    whole model ("in_features=60 is not a multiple of the group size 60"); it now keeps that layer as loaded, says
    so in the weight format, and the experts (not all 4-bit) are held dequantized with the model's own tokens."""
    from engine.exec.experts.pool import ExpertPool
    from engine.model.config import MoEConfig
    from engine.model.moe import sparse_blocks
    from engine.model.random_checkpoint import write_random_checkpoint

    src = write_random_checkpoint(tmp_path / "odd", size="moe-tiny", moe=MoEConfig(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=60, norm_topk_prob=True, mlp_only_layers=(1,)))
    lm = load_checkpoint(src, dtype="float32", device="cpu", quantize="int4")
    assert "as loaded" in lm.weight_format, lm.weight_format
    block = sparse_blocks(lm.model)[0]
    assert type(block.experts[0].down_proj) is torch.nn.Linear and block.experts[0].down_proj.in_features == 60
    assert block.experts[0].gate_proj.__class__.__name__ == "IntGroupLinear" and not int4_experts(block)
    pool = ExpertPool(block, torch.device("cpu"), torch.device("cpu"), pin=False)
    assert pool.store_down.dtype == torch.float32
    x = torch.randn(3, 60, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(x @ pool.host_weights(5, torch.float32)[1].T, block.experts[5].down_proj(x))
    prompts = random_prompts(2, seed=7, lengths=(12, 30))
    (resident, no_misses), (small, misses) = [(tokens, got["snap"].misses) for tokens, got in
                                               (_run(src, prompts, slots=slots, batch=2) for slots in (None, 3))]
    assert no_misses == 0 and misses > 0 and small == resident


def test_the_books_count_what_each_layers_pool_holds_when_the_layers_differ(tmp_path_factory):
    """One layer's experts 4-bit and another's held dequantized (an act-order expert there): the cache's MiB are
    the bytes its pools hold, at start and after a resize, not the first layer's expert times the layers."""
    from engine.exec.experts.cache import ExpertCache
    from engine.model.moe import sparse_blocks
    from engine.telemetry import EventBus
    from tests.engine.engine_helpers import shared_lively_checkpoint

    ckpt = shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")
    model = load_checkpoint(ckpt, dtype="float32", device="cpu", quantize="int4").model
    blocks = sparse_blocks(model)
    assert len(blocks) >= 2
    proj = blocks[-1].experts[0].down_proj
    proj.register_buffer("perm", torch.arange(proj.in_features).flip(0))
    assert int4_experts(blocks[0]) and not int4_experts(blocks[-1])
    cache = ExpertCache(model, torch.device("cpu"), EventBus(), slots=4)

    def held_mib() -> float:
        return sum(t.numel() * t.element_size() for p in cache.pools
                   for t in (p.gate_up, p.down, *(p.quant.tensors() if p.quant is not None else ()))) / 2**20

    assert cache.mib == pytest.approx(held_mib())
    cache.set_budget(cache.mib_for(7), "test")
    assert cache.slots == 7 and cache.mib == pytest.approx(held_mib())
    cache.prefetch(len(blocks) - 1, [1, 2])
    assert cache.snapshot().loaded_mib == pytest.approx(2 * expert_bytes(blocks[-1]) / 2**20, abs=1e-3)


# --- CUDA ----------------------------------------------------------------------------------------------------------


def _gpu_tokens(batch: int, slots: int | None = None, **kw):
    # Every prompt in the first step, then steps of every row: the small config's chunks (64 tokens, 128 a step)
    # are paced by measured step times (engine.core.prefill_pacer), so a cold run (slower steps) and even a second
    # all-resident run split the prompts into other chunks beside other decode rows, and a row's token is computed
    # in a step of other rows: the int4 linears take their path by the rows / sequences of the step
    # (engine.model.quant.kernels.path_of: the GEMV at 1-4, the tensor cores past it, agreeing only to rounding),
    # and in bf16 a near-tie flipped one row late in its sequence (batch 6, prefetch).
    kw = dict(prefill_chunk_tokens=128, step_token_budget=1024) | kw
    engine = make_engine(MODEL, device="cuda:0", dtype="bfloat16", batch=batch, quantize="int4", **kw)
    cache = engine.lm.model.expert_provider
    if slots is not None:
        cache.set_budget(cache.mib_for(slots), "test")
    try:
        assert cache.pools[0].gate_up.dtype == torch.int32
        tokens = tokens_of(run_all(engine, random_prompts(batch, seed=11, lengths=(20, 90)), GREEDY))
        return tokens, cache.snapshot()
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 6])
def test_gpu_int4_experts_give_the_all_resident_tokens_across_cache_budgets(batch):
    """Under CUDA graphs in bf16, through the 4-bit Triton kernels: each cold path and budget gives the
    all-resident bits (a route's product does not depend on the other routes of its step)."""
    resident, snap = _gpu_tokens(batch)
    assert snap.misses == 0 and snap.hits > 0
    for slots, mode in ((8, "copy"), (4, "copy"), (4, "prefetch"), (4, "cpu")):
        tokens, snap = _gpu_tokens(batch, slots=slots, switches=cold_switches(mode))
        print(f"batch {batch} slots {slots} {mode}: misses {snap.misses}, replays {snap.replays}, "
              f"reruns {snap.reruns}")
        assert snap.misses > 0
        if mode != "cpu":  # the cpu path computes a cold expert on the host: the same weights, other sums
            assert tokens == resident, (slots, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [None, 4], ids=["resident", "cold"])
def test_gpu_int4_mtp_on_gives_the_mtp_off_tokens_at_batch_6(slots):
    """MTP's verify rows route through the same 4-bit kernels as decode rows (fp32, as the bf16 MTP check of
    tests/engine/test_engine_synthetic_gpu.py runs)."""
    runs = []
    for mtp in ({}, dict(batch_mtp=True, mtp_depth=2)):
        engine = make_engine(MODEL, device="cuda:0", dtype="float32", batch=6, quantize="int4", **mtp)
        cache = engine.lm.model.expert_provider
        if slots is not None:
            cache.set_budget(cache.mib_for(slots), "test")
        try:
            runs.append((tokens_of(run_all(engine, random_prompts(6, seed=11, lengths=(20, 90)), GREEDY)),
                         cache.snapshot()))
        finally:
            engine.close()
    (plain, _), (with_mtp, snap) = runs
    assert with_mtp == plain
    assert (snap.misses > 0) == (slots is not None)
