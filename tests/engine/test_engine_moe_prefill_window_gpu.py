"""CUDA checks of the layer-major prefill window (engine/exec/prefill_window.py; skipped without a GPU): with the
device's own paths (FUSED_OPS' carried residual, the fused or paged chunk attention, copies on the side stream in
batches overlapping the residents' compute) a long prompt gives the chunk-by-chunk tokens, with short requests
decoding beside it, and each cold expert crosses once per window and layer."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu
CUDA = "cuda:0"
MODEL = "random:moe-synth-tiny"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CHUNK_TOKENS = 64


def _run(window_tokens: int, **kw):
    # fp32: the chunk path's and the window's expert products in other groupings give the same greedy tokens
    prompts = random_prompts(1, seed=11, lengths=(1000, 1001)) + random_prompts(2, seed=12, lengths=(8, 20))
    engine = make_engine(MODEL, device=CUDA, dtype="float32", batch=3, prefill_chunk_tokens=CHUNK_TOKENS,
                         step_token_budget=CHUNK_TOKENS, expert_cache_mib=1, prefill_window_tokens=window_tokens, **kw)
    cache = engine.lm.model.expert_provider
    try:
        tokens = tokens_of(run_all(engine, prompts, GREEDY))
        routed: dict[int, set[int]] = {}
        for access in cache.stats.trace:
            if access.kind == "prefill" and access.layer < cache.main_layers:
                routed.setdefault(access.layer, set()).update(access.experts)
        return tokens, cache.snapshot(), routed, cache.main_layers
    finally:
        engine.close()


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_gpu_window_gives_the_chunk_by_chunk_tokens_and_one_crossing_per_window(mtp):
    extra = {"batch_mtp": True, "mtp_depth": 2} if mtp else {}
    plain, chunked, _, _ = _run(0, **extra)
    windowed, snap, routed, main_layers = _run(16384, **extra)
    print(f"prompt copies: chunk by chunk {chunked.prompt_loaded_experts}, one window "
          f"{snap.prompt_loaded_experts} ({[snap.layers[i].prompt_loaded for i in range(main_layers)]})")
    assert windowed == plain
    # three prompts, each one window: a cold expert crosses at most once per prompt and layer
    assert all(0 < snap.layers[i].prompt_loaded <= 3 * len(routed[i]) for i in range(main_layers))
    assert snap.prompt_loaded_experts < chunked.prompt_loaded_experts
