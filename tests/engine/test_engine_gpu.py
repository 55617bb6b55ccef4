"""GPU runs of the engine (skipped without CUDA): graphs, the preallocated tier, and the seed scenario.

The seed report's scenario: six slots decoding with --batch-mtp and SPLIT_ATTN, VRAM near-full by design (the
tier took it), then a fresh long prompt arrives. The engine must not exit: graph captures that run out of
memory get room from the tier (or degrade the switch with a WARNING), and every request completes.
"""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, shared_lively_checkpoint, tokens_of

pytestmark = pytest.mark.gpu


def _engine(ckpt, bus=None, **kw) -> Engine:
    base = dict(model=str(ckpt), device="cuda:0", dtype="float32", batch=6, context=4096,
                prefill_chunk_tokens=256, step_token_budget=512)
    base.update(kw)
    return Engine(EngineConfig(**base), bus or EventBus(history=100000), block_tokens=16)


def test_gpu_greedy_with_graphs_matches_eager_and_mtp_is_lossless(ckpt):
    prompts = random_prompts(12, seed=90, lengths=(10, 300))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = tokens_of(run_all(_engine(ckpt, graphs=False), prompts, params))
    graphs = _engine(ckpt, graphs=True)
    assert type(graphs.graphs).__name__ == "GraphCache"
    assert tokens_of(run_all(graphs, prompts, params)) == eager
    # the next greedy step went ahead of the host's reading (engine.exec.decode_ahead) and was taken
    assert graphs.ahead.enabled and graphs.ahead.taken > 0, (graphs.ahead.taken, graphs.ahead.dropped)
    # A lone short prompt chunk replays a captured graph from its bucket's third sight (the prompt-chunk kernel
    # needs no chunk start baked in; an eager 28-layer chunk is bound by the host's launches). A burst's chunks
    # above ran as rows of shared forwards instead (engine.exec.chunk_rows): lone prompts, one at a time, here.
    lone = random_prompts(3, seed=91, lengths=(100, 120))
    eager_engine = _engine(ckpt, graphs=False)
    for i, prompt in enumerate(lone):
        alone = tokens_of(run_all(graphs, [prompt], params, prefix=f"lone{i}-"))
        assert alone == tokens_of(run_all(eager_engine, [prompt], params, prefix=f"lone{i}-"))
    kinds = {(g.kind, g.replays > 0) for g in graphs.graphs.snapshot().graphs}
    assert ("prefill", True) in kinds, kinds
    mtp = _engine(ckpt, graphs=True, batch_mtp=True, mtp_depth=2)
    assert tokens_of(run_all(mtp, prompts, params)) == eager
    assert mtp.mtp_on
    # MTP's fused steps went ahead too (their pending tokens and positions from the step before, on the device)
    assert mtp.drafter.fused and mtp.ahead.taken > 0, (mtp.ahead.taken, mtp.ahead.dropped)


def test_gpu_tier_takes_free_vram_and_release_gives_it_back(ckpt):
    engine = _engine(ckpt)
    tier = engine.tier
    assert tier.preallocate and tier.capacity_blocks > 0, (tier.capacity_blocks, tier.mib)
    free_before = torch.cuda.mem_get_info()[0]
    # 1 GiB, what a graph capture asks for; the driver need gain only half of it: this tiny model's blocks are
    # 8 KiB, and blocks under 1 MiB share the allocator's 2 MiB segments, so which go back depends on the layout.
    freed_mib = tier.release(1024.0, "test")
    gained_mib = (torch.cuda.mem_get_info()[0] - free_before) / 2**20
    print(f"tier {tier.capacity_blocks} blocks of {tier.block_mib:.4f} MiB; released {freed_mib:.1f} MiB, the driver "
          f"gained {gained_mib:.1f} MiB")
    assert freed_mib >= 1024.0 - 1e-6
    assert gained_mib >= 512.0


@pytest.mark.soak
def test_gpu_seed_scenario_fresh_long_prompt_while_six_slots_decode_with_split_attn(tmp_path_factory):
    """0.6b-shaped random model, int8 KV, 6 slots + MTP + SPLIT_ATTN, VRAM near-full by the tier. A soak (`-m
    soak`): it is too long for the `-m gpu` suite's time limit; benchmarks/seed_scenario.py runs the same
    scenario against a real `serve` in every GPU run (benchmarks/run_all_gpu.sh)."""
    ckpt = shared_lively_checkpoint(tmp_path_factory, size="0.6b")
    bus = EventBus(history=200000)
    engine = _engine(ckpt, bus=bus, dtype="bfloat16", batch=7, context=40960, kv="int8", batch_mtp=True,
                     mtp_depth=2, prefill_chunk_tokens=2048, step_token_budget=4096,
                     switches={"SPLIT_ATTN": True})
    short = random_prompts(6, seed=91, lengths=(50, 200), vocab=500)
    for i, prompt in enumerate(short):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(20):
        engine.step()
    long_prompt = random_prompts(1, seed=92, lengths=(36000, 36001), vocab=500)[0]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.health().ready, engine.health().reason
    assert {rid: o.finish_reason for rid, o in finals.items()} == {**{f"s{i}": "length" for i in range(6)},
                                                                    "long": "length"}
    errors = [e for e in bus.history() if e.type == "error"]
    assert not errors, errors[-1].message


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_peer_device_holds_the_tier_and_prefix_reuse_works_across_devices(ckpt):
    bus = EventBus(history=100000)
    engine = _engine(ckpt, bus=bus, peer_device="cuda:1")
    assert engine.tier.device == torch.device("cuda:1")
    prompt = random_prompts(1, seed=93, lengths=(200, 201))[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = tokens_of(run_all(engine, [prompt], params, prefix="a"))["a0"]
    second = tokens_of(run_all(engine, [prompt], params, prefix="b"))["b0"]
    assert first == second
    assert [e.reuse for e in bus.history() if e.type == "admission"] == ["fresh", "reused"]
    assert {v["device"] for v in engine.state().to_json()["vram"]} == {"cuda:0", "cuda:1"}


def test_gpu_prefill_chunks_take_the_flash_kernel_in_bf16(ckpt):
    engine = _engine(ckpt, dtype="bfloat16")
    cfg = engine.lm.config
    assert engine.kv.chunk_fusable(cfg.num_attention_heads, 64)
