"""CUDA checks of the synthetic MoE source and the cold-expert paths (skipped without a GPU): the model generated
on the device is the same every load with its store pinned, the three cold paths give the all-resident tokens
under CUDA graphs, and with `--expert-cache-mib auto` a graph capture's out-of-memory shrinks the expert cache
before the prefix tier and serving continues."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.model import load_checkpoint
from engine.model.moe import sparse_blocks
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of
from tests.fault_injection import installed

pytestmark = pytest.mark.gpu
CUDA = "cuda:0"
MODEL = "random:moe-synth-tiny"
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SWITCH = {"copy": {}, "cpu": {"EXPERT_CPU": True}, "prefetch": {"EXPERT_PREFETCH": True}}


@pytest.mark.gpu_shared
def test_gpu_synthetic_source_is_the_same_model_every_load_with_a_pinned_store():
    """Two loads draw the same weights: the dense ones on the GPU, the experts into a pinned host store (what the
    expert cache copies from; the model alone does not run on it, the engine's expert provider does)."""
    loads = []
    for _ in range(2):
        lm = load_checkpoint(MODEL, dtype="bfloat16", device=CUDA, expert_device="cpu")
        blocks = sparse_blocks(lm.model)
        assert blocks and all(b.expert_store[0].device.type == "cpu" and b.expert_store[0].is_pinned() for b in blocks)
        assert lm.model.embed_tokens.weight.device.type == "cuda"
        dense = {name: p.detach().cpu() for name, p in lm.model.named_parameters() if p.device.type == "cuda"}
        loads.append((dense, [[t.clone() for t in b.expert_store] for b in blocks]))
        del lm
    (dense_a, experts_a), (dense_b, experts_b) = loads
    assert dense_a.keys() == dense_b.keys() and len(dense_a) > 4
    assert all(torch.equal(dense_a[name], dense_b[name]) for name in dense_a)
    assert all(torch.equal(a, b) for block_a, block_b in zip(experts_a, experts_b) for a, b in zip(block_a, block_b))
    assert any(float(t.float().abs().sum()) > 0 for t in experts_a[0])  # drawn, not zeros


def _tokens(bus=None, **kw):
    # fp32: the captured path (gathered slots), the eager re-run and the CPU's expert sum in other orders
    engine = make_engine(MODEL, bus=bus, device=CUDA, dtype="float32", batch=3, **kw)
    try:
        tokens = tokens_of(run_all(engine, random_prompts(3, seed=5, lengths=(20, 90)), GREEDY))
        return tokens, engine.lm.model.expert_provider.snapshot()
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["copy", "cpu", "prefetch"])
def test_gpu_each_cold_path_gives_the_all_resident_tokens_under_cuda_graphs(mode):
    resident, _ = _tokens()
    tokens, snap = _tokens(expert_cache_mib=1, switches=SWITCH[mode])
    print(f"{mode}: slots {snap.slots}, hit rate {snap.hit_rate}, oracle {snap.oracle_hit_rate}, "
          f"replays {snap.replays}, reruns {snap.reruns}, prefetched {snap.prefetched} of {snap.steps} steps")
    assert snap.cold == mode and snap.misses > 0
    assert tokens == resident


def test_gpu_capture_oom_shrinks_the_auto_expert_cache_before_the_tier():
    resident, _ = _tokens()
    bus = EventBus()
    with installed("capture:decode:1-2:oom"):  # the engine built in process reads no environment for faults
        tokens, snap = _tokens(bus=bus, expert_cache_mib="auto")
    shrinks = [(e.seq, e) for e in bus.history() if e.type == "expert" and e.action == "shrink"]
    tier_shrinks = [e.seq for e in bus.history() if e.type == "tier" and e.action == "shrink"]
    print("expert shrinks:", [(e.slots, e.reason) for _, e in shrinks], "tier shrinks:", len(tier_shrinks))
    assert shrinks and "out of memory" in shrinks[0][1].reason
    assert not tier_shrinks or tier_shrinks[0] > shrinks[0][0]  # the experts gave first
    assert any(e.type == "graph" and e.action == "wait" and e.mib > 0 for e in bus.history())
    assert tokens == resident  # serving went on, with the same tokens


def _batch_tokens(batch: int, dtype: str = "bfloat16", slots: int | None = None, **kw):
    engine = make_engine(MODEL, device=CUDA, dtype=dtype, batch=batch, **kw)
    if slots is not None:  # a budget in slots (bf16 experts of this model are KiBs: 1 MiB holds them all)
        cache = engine.lm.model.expert_provider
        cache.set_budget(cache.mib_for(slots), "test")
    try:
        tokens = tokens_of(run_all(engine, random_prompts(batch, seed=11, lengths=(20, 90)), GREEDY))
        return tokens, engine.lm.model.expert_provider.snapshot()
    finally:
        engine.close()


@pytest.mark.parametrize("batch", [1, 6])
def test_gpu_bf16_cold_paths_give_the_all_resident_tokens(batch):
    """In bf16, where another sum order can flip a greedy token: each route's product comes from one kernel at a
    launch shape fixed by the step's route count, and the block sums a token's routes once, in one order
    (engine.model.moe_kernels), so a replay, its eager re-run and a copied or prefetched expert all give the
    all-resident bits."""
    resident, snap = _batch_tokens(batch)
    # every expert resident: replays stand unchecked, their counts recorded a step late; none is lost
    assert snap.misses == 0 and snap.hits > 0 and snap.hit_rate == 1.0
    assert snap.trace_accesses >= snap.num_layers * GREEDY.max_tokens // 2, (snap.trace_accesses, snap.num_layers)
    for mode in ("copy", "prefetch"):
        tokens, snap = _batch_tokens(batch, slots=4, switches=SWITCH[mode])
        print(f"batch {batch} {mode}: replays {snap.replays}, reruns {snap.reruns}, prefetched {snap.prefetched}")
        assert snap.misses > 0 and snap.reruns + snap.replays > 0
        assert tokens == resident, mode


@pytest.mark.parametrize("cache_mib", [None, 1], ids=["resident", "cold"])
def test_gpu_mtp_on_gives_the_mtp_off_tokens_at_batch_6(cache_mib):
    """MTP's verify rows route through the same kernels as decode rows (fp32, as the dense MTP check runs: cuBLAS
    picks other bf16 algorithms for two rows than for one)."""
    plain, _ = _batch_tokens(6, "float32", expert_cache_mib=cache_mib)
    mtp, snap = _batch_tokens(6, "float32", expert_cache_mib=cache_mib, batch_mtp=True, mtp_depth=2)
    assert mtp == plain
    assert (snap.misses > 0) == (cache_mib is not None)


def test_gpu_every_expert_resident_goes_ahead_with_the_tokens_of_a_run_without_it():
    """All resident on CUDA: decode ahead is on by default and the replays' counts are read a step late; the
    tokens are those of a run with neither."""
    plain, _ = _batch_tokens(6, decode_ahead="off")
    engine = make_engine(MODEL, device=CUDA, dtype="bfloat16", batch=6)
    try:
        assert engine.ahead.enabled
        ahead = tokens_of(run_all(engine, random_prompts(6, seed=11, lengths=(20, 90)), GREEDY))
        assert engine.ahead.taken > 0, (engine.ahead.taken, engine.ahead.dropped)
        snap = engine.lm.model.expert_provider.snapshot()
        assert snap.misses == 0 and snap.hits > 0
    finally:
        engine.close()
    assert ahead == plain
