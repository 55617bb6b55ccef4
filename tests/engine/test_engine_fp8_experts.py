"""FP8 experts (`--quantize fp8` on a synthetic MoE): they stay e4m3 in the store and in the cache's slots with
their per-channel scales, every budget and cold path gives the all-resident tokens, and the model follows its
16-bit self."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.model import load_checkpoint
from engine.model.moe_quant import Fp8Experts
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

MODEL = "random:moe-synth-tiny"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SWITCH = {"copy": {}, "cpu": {"EXPERT_CPU": True}, "prefetch": {"EXPERT_PREFETCH": True}}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=3, lengths=(12, 40))


def _run(prompts, captured: bool = False, slots: int | None = None, **kw):
    with one_thread():
        engine = make_engine(MODEL, batch=3, quantize="fp8", **kw)
        cache = engine.lm.model.expert_provider
        if slots is not None:
            cache.set_budget(cache.mib_for(slots), "test")
        if captured:
            cache.capturing = lambda x: True  # the graph-safe path, run eagerly
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            pool, block = cache.pools[0], cache.blocks[0]
            return tokens, dict(snap=cache.snapshot(), store_dtype=pool.store_gate_up.dtype,
                                slot_dtype=pool.gate_up.dtype, scales=isinstance(pool.quant, Fp8Experts),
                                expert_bytes=cache.expert_mib * 2**20, H=block.gate.in_features,
                                I=block.intermediate_size)
        finally:
            engine.close()


@pytest.fixture(scope="module")
def resident(prompts):
    return _run(prompts)


def test_fp8_experts_stay_fp8_in_the_store_and_the_slots(resident):
    _, got = resident
    assert got["snap"].misses == 0 and got["scales"]
    assert got["store_dtype"] == got["slot_dtype"] == torch.float8_e4m3fn
    H, I = got["H"], got["I"]
    assert got["expert_bytes"] == 3 * H * I + 4 * (2 * I + H)  # one byte a weight, four a channel's scale


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("mode", ["copy", "cpu", "prefetch"])
def test_every_cold_path_gives_the_all_resident_fp8_tokens(prompts, resident, mode, captured):
    tokens, got = _run(prompts, captured, slots=4, switches=SWITCH[mode])
    snap = got["snap"]
    assert snap.misses > 0 and snap.slots == 4
    assert tokens == resident[0]


def test_the_fp8_model_follows_its_16_bit_self():
    """The same seeded model in fp32 and with FP8 projections and experts: next-token logits within the rounding
    of e4m3 (3 mantissa bits), and the reference path reads the FP8 store dequantized."""
    ids = torch.tensor([random_prompts(1, seed=9, lengths=(24, 25))[0]])
    logits = []
    for quantize in (None, "fp8"):
        lm = load_checkpoint(MODEL, dtype="float32", device="cpu", quantize=quantize)
        assert isinstance(lm.model.layers[0].mlp.expert_quant, Fp8Experts) == (quantize == "fp8")
        with torch.no_grad():
            logits.append(lm.model(ids, positions=torch.arange(ids.shape[1])[None]).float())
    full, fp8 = logits
    err = ((fp8 - full).norm() / full.norm()).item()
    assert 1e-4 < err < 0.1, err  # rounded (not the same weights), but close


def test_a_synthetic_source_refuses_the_formats_it_has_no_form_of():
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8 \\(per channel\\) and int4 \\(per group\\) only"):
        load_checkpoint(MODEL, dtype="float32", device="cpu", quantize="fp8-block")


def test_a_checkpoint_quantized_to_fp8_at_load_keeps_its_experts_fp8_in_the_cache(tmp_path_factory):
    """`--quantize fp8` on a Qwen3-MoE checkpoint: each expert's projections become per-channel FP8 modules, and
    the cache keeps them FP8 (weights and scales) instead of dequantizing; a small budget gives the all-resident
    tokens."""
    from tests.engine.engine_helpers import shared_lively_checkpoint

    ckpt = shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")
    prompts = random_prompts(2, seed=6, lengths=(12, 30))
    runs = []
    for slots in (None, 3):
        with one_thread():
            engine = make_engine(ckpt, batch=2, quantize="fp8")
            cache = engine.lm.model.expert_provider
            if slots is not None:
                cache.set_budget(cache.mib_for(slots), "test")
            try:
                pool = cache.pools[0]
                assert pool.store_gate_up.dtype == pool.gate_up.dtype == torch.float8_e4m3fn
                assert isinstance(pool.quant, Fp8Experts)
                assert pool.quant.gate_up_scale.shape == (pool.slots + 1, pool.gate_up.shape[1])
                runs.append((tokens_of(run_all(engine, prompts, GREEDY)), cache.snapshot().misses))
            finally:
                engine.close()
    (resident, no_misses), (small, misses) = runs
    assert no_misses == 0 and misses > 0
    assert small == resident
