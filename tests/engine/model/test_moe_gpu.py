"""CUDA checks of Qwen3-MoE and the expert cache (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.model import load_checkpoint
from engine.telemetry import EventBus
from tests.engine.engine_helpers import (make_engine, random_prompts, run_all, shared_lively_checkpoint,
                                        tier_starving_reserve_mib, tokens_of)
from tests.engine.model.test_model_moe import _hf_moe, _prompt
from tests.fault_injection import installed

pytestmark = pytest.mark.gpu
CUDA = "cuda:0"
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.gpu_shared
def test_gpu_moe_bf16_parity_with_transformers(tmp_path):
    ref = _hf_moe(tmp_path, norm_topk_prob=True)
    ids, positions = (t.to(CUDA) for t in _prompt())
    with torch.no_grad():
        exact = ref.to(CUDA)(ids).logits.float()
        hf_bf16 = ref.to(torch.bfloat16)(ids).logits.float()
        lm = load_checkpoint(tmp_path, dtype="bfloat16", device=CUDA, tokenizer=False)
        ours = lm.model.logits(lm.model(ids, positions)).float()
    hf_err, err = (hf_bf16 - exact).abs().max().item(), (ours - exact).abs().max().item()
    print(f"bf16 MoE parity: ours {err:.4f}, transformers' own bf16 {hf_err:.4f} (max abs logit error vs fp32)")
    # as test_model_gpu: our bf16 error of the order of transformers' own, plus 1e-2 (~2.5 bf16 steps);
    # a routing mistake (another expert chosen) would show as O(0.1)
    assert err <= 2 * hf_err + 1e-2


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")


def _engine_tokens(moe_ckpt, bus=None, **kw):
    # fp32: the captured path (gathered slots) and the eager re-run (one expert at a time) sum in other orders
    engine = make_engine(moe_ckpt, bus=bus, device=CUDA, dtype="float32", batch=3, **kw)
    try:
        tokens = tokens_of(run_all(engine, random_prompts(3, seed=5, lengths=(20, 90)), GREEDY))
        return tokens, engine.lm.model.expert_provider.snapshot()
    finally:
        engine.close()


def test_gpu_expert_cache_under_cuda_graphs(moe_ckpt):
    resident, snap_all = _engine_tokens(moe_ckpt)
    small, snap = _engine_tokens(moe_ckpt, expert_cache_mib=1)
    print(f"all resident: {snap_all.hits} hits; 1 MiB: slots {snap.slots}, hit rate {snap.hit_rate}, "
          f"oracle {snap.oracle_hit_rate}, replays {snap.replays}, reruns {snap.reruns} of {snap.steps} steps")
    assert snap_all.misses == 0 and snap_all.reruns == 0
    assert snap.misses > 0 and snap.replays + snap.reruns > 0 and snap.reruns < snap.steps
    assert small == resident


def test_gpu_graph_capture_oom_shrinks_the_expert_cache(moe_ckpt):
    resident, _ = _engine_tokens(moe_ckpt)
    # The tier answers first and, on CUDA, takes every free MiB past the reserve at start and regrows into it
    # (so with tier_budget_mib=0 alone, or a reserve that leaves it a few GiB, the tier gives the capture its
    # room and the experts are never asked). A reserve that leaves the tier at most 64 MiB, less
    # than the 256 MiB a capture asks for, leaves the rest to the expert cache.
    reserve_mib = tier_starving_reserve_mib(lambda: make_engine(moe_ckpt, device=CUDA, dtype="float32", batch=3))
    bus = EventBus()
    with installed("capture:decode:1-2:oom"):
        tokens, snap = _engine_tokens(moe_ckpt, bus=bus, tier_budget_mib=0.0, vram_reserve_mib=reserve_mib)
    events = [e for e in bus.history() if e.type == "expert"]
    print("expert events:", [(e.action, e.slots, e.reason) for e in events if e.action in ("shrink", "grow")])
    print("graph events:", [(e.action, e.kind, e.mib) for e in bus.history() if e.type == "graph"][:12])
    print("tier events:", [(e.action, e.mib, e.reason) for e in bus.history() if e.type == "tier"][:12])
    shrinks = [e for e in events if e.action == "shrink"]
    assert shrinks and "out of memory" in shrinks[0].reason and shrinks[0].slots < 16
    assert any(e.type == "graph" and e.action == "wait" for e in bus.history())
    assert tokens == resident  # shrunk (and regrown by the periodic rebalance once room showed), same tokens


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
def test_gpu_expert_store_on_the_peer_device_under_cuda_graphs(moe_ckpt):
    resident, _ = _engine_tokens(moe_ckpt)
    engine = make_engine(moe_ckpt, device=CUDA, dtype="float32", batch=3, expert_cache_mib=1, peer_device="cuda:1")
    try:
        cache = engine.lm.model.expert_provider
        assert all(p.store_gate_up.device == torch.device("cuda:1") for p in cache.pools)
        assert all(p.gate_up.device == torch.device(CUDA) for p in cache.pools)
        tokens = tokens_of(run_all(engine, random_prompts(3, seed=5, lengths=(20, 90)), GREEDY))
        snap = cache.snapshot()
        vram = {v["device"]: v for v in engine.state().to_json()["vram"]}
    finally:
        engine.close()
    print(f"peer store: {snap.peer_mib:.1f} MiB on cuda:1, hit rate {snap.hit_rate}, loaded "
          f"{snap.loaded_mib:.1f} MiB in {snap.load_ms:.1f} ms, replays {snap.replays}, reruns {snap.reruns}")
    assert tokens == resident  # misses copied cuda:1 -> cuda:0 (replays and eager re-runs) change nothing
    assert snap.store_device == "cuda:1" and snap.host_mib == 0.0 and snap.peer_mib > 0
    assert snap.misses > 0 and snap.loaded_mib > 0
    assert vram["cuda:1"]["weights_mib"] == round(snap.peer_mib, 1)  # the peer's books count the store


@two_gpus
def test_gpu_a_peer_store_that_cannot_fit_is_a_config_error(moe_ckpt):
    from engine.errors import ConfigError

    free_mib = torch.cuda.mem_get_info(1)[0] / 2**20
    with pytest.raises(ConfigError, match="peer_device='cuda:1'.*routed experts need"):
        # a reserve of everything free on the peer but 1 MiB (the compute card has the same reserve, but more free)
        make_engine(moe_ckpt, device=CUDA, dtype="float32", batch=1, expert_cache_mib=1, peer_device="cuda:1",
                    vram_reserve_mib=int(free_mib - 1))
