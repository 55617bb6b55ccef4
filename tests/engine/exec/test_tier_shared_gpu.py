"""GPU runs of prefix reuse by reference (skipped without CUDA): the preallocated tier's blocks live in the KV pool
on the compute device, a reused prefix is mapped into the slot's block table under CUDA graphs and the paged
kernels, and a release that reaches the pool reallocates it (graphs dropped, recaptured) with the mapped KV intact.
"""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.exec.kv.cache import SlotKVCache
from engine.telemetry import EventBus
from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _engine(ckpt, bus: EventBus | None = None, **kw) -> Engine:
    base = dict(model=str(ckpt), device="cuda:0", dtype="float32", batch=4, context=4096,
                prefill_chunk_tokens=256, step_token_budget=512, switches={"SHARED_PREFIX": True})
    base.update(kw)
    return Engine(EngineConfig(**base), bus or EventBus(history=100000))  # the default 256-token tier blocks


def test_gpu_reuse_maps_the_pool_tier_blocks_under_graphs_and_matches_the_fresh_run(ckpt, monkeypatch):
    engine = _engine(ckpt, batch_mtp=True, mtp_depth=2)
    tier = engine.tier
    assert tier.shared is not None and tier.preallocate and len(tier.shared.backing) > 0
    assert type(engine.graphs).__name__ == "GraphCache"
    prompt = random_prompts(1, seed=95, lengths=(1100, 1101))[0]
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]

    def refuse(*args, **kwargs):
        raise AssertionError("KV was copied between a slot and the tier")

    monkeypatch.setattr(SlotKVCache, "read_span", refuse)
    monkeypatch.setattr(SlotKVCache, "write_span", refuse)
    second = run_all(engine, [prompt], GREEDY, prefix="b")["b0"]
    assert second[-1].cached_tokens == 1024
    assert [t for o in second for t in o.token_ids] == first
    assert (tier.shared_blocks, tier.copied_in_blocks) == (4, 0)
    engine.close()


def test_gpu_a_release_reaching_the_pool_reallocates_it_and_keeps_what_a_slot_maps(ckpt):
    engine = _engine(ckpt)
    tier, kv = engine.tier, engine.kv
    prompt, other = random_prompts(2, seed=96, lengths=(1100, 1101))
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    run_all(engine, [other], GREEDY, prefix="o")
    engine.add_request("b0", prompt, GREEDY)
    outs = list(engine.step())  # admitted: its 4 prefix blocks are mapped
    assert engine.graphs.snapshot().graphs
    pool_blocks = kv.k[0].shape[1]
    free_before = torch.cuda.mem_get_info()[0]
    freed = tier.release(tier.mib, "test")  # own blocks first, then the pool's: it is reallocated
    assert freed > 0 and kv.k[0].shape[1] < pool_blocks
    assert len(tier.shared.backing) == 4 and tier._blocks == {}  # only the mapped blocks stay
    assert engine.graphs.snapshot().graphs == []  # they read the old pool tensors: dropped
    assert torch.cuda.mem_get_info()[0] > free_before
    while engine.has_work:
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == first
    assert engine.graphs.snapshot().graphs  # recaptured on the new pool
    engine.close()


def test_gpu_capture_all_graphs_are_captured_again_after_the_pool_grew_for_the_tier(ckpt):
    bus = EventBus(history=100000)
    engine = _engine(ckpt, bus=bus, switches={"CAPTURE_ALL": True, "SHARED_PREFIX": True})
    assert engine.tier.shared is not None and len(engine.tier.shared.backing) > 0
    assert not engine.board.states["CAPTURE_ALL"].degraded
    held = {(g.kind, g.key) for g in engine.graphs.snapshot().graphs}
    assert {kind for kind, _ in held} == {"decode"}  # captured again on the grown pool, not just dropped
    at_start = len([e for e in bus.history() if e.type == "graph" and e.action == "capture"])
    run_all(engine, random_prompts(3, seed=97, lengths=(20, 300)), GREEDY)
    later = [e for e in bus.history() if e.type == "graph" and e.action == "capture"][at_start:]
    assert [e for e in later if e.kind == "decode"] == []
    engine.close()


def test_gpu_a_small_release_takes_own_blocks_and_keeps_the_pool_and_the_graphs(ckpt):
    engine = _engine(ckpt)
    tier, kv = engine.tier, engine.kv
    books = engine.budget.breakdown()
    print(f"tier: {tier.capacity_blocks} blocks of {tier.block_mib:.3f} MiB, {len(tier._blocks)} own, "
          f"{len(tier.shared.backing)} in the pool; books {books}; tier events "
          f"{[(e.action, e.mib, e.reason) for e in engine.bus.history() if e.type == 'tier'][:8]}")
    assert tier._blocks and tier.shared.backing  # own blocks (4 x max(reserve, 1 GiB)) beside the pool's
    run_all(engine, random_prompts(2, seed=98, lengths=(300, 700)), GREEDY)
    graphs = {(g.kind, g.key) for g in engine.graphs.snapshot().graphs}
    pool_blocks, backed = kv.k[0].shape[1], len(tier.shared.backing)
    free_before = torch.cuda.mem_get_info()[0]
    assert tier.release(256.0, "test") >= 256.0
    assert kv.k[0].shape[1] == pool_blocks and len(tier.shared.backing) == backed  # the pool was not touched
    assert {(g.kind, g.key) for g in engine.graphs.snapshot().graphs} == graphs
    assert torch.cuda.mem_get_info()[0] > free_before
    engine.close()
