"""The real Engine on a Qwen3-MoE checkpoint (CPU): MTP drafting is lossless, and an expert cache too small to
hold a layer's routed experts gives the same greedy tokens as the all-resident run."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, shared_lively_checkpoint, tokens_of

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=5, lengths=(20, 90))


@pytest.fixture(scope="module")
def plain_tokens(moe_ckpt, prompts):
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3)
        try:
            return tokens_of(run_all(engine, prompts, GREEDY))
        finally:
            engine.close()


def test_moe_greedy_mtp_on_is_identical_to_off(moe_ckpt, prompts, plain_tokens):
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, batch_mtp=True, mtp_depth=2)
        try:
            drafted = tokens_of(run_all(engine, prompts, GREEDY))
        finally:
            engine.close()
    assert drafted == plain_tokens
    assert len({tuple(t) for t in plain_tokens.values()}) == 3  # varied output, not one repeated token


def _run(moe_ckpt, prompts, **kw):
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, **kw)
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            return tokens, engine.lm.model.expert_provider.snapshot(), engine
        finally:
            engine.close()


def test_all_resident_by_default_never_misses(moe_ckpt, prompts, plain_tokens):
    tokens, snap, _ = _run(moe_ckpt, prompts)
    assert tokens == plain_tokens
    assert snap.slots == snap.num_experts == 16 and snap.misses == 0 and snap.hits > 0


def test_small_expert_cache_misses_and_gives_the_all_resident_tokens(moe_ckpt, prompts, plain_tokens):
    tokens, snap, _ = _run(moe_ckpt, prompts, expert_cache_mib=1)
    assert snap.slots == 6  # 1 MiB / (3 sparse layers x 48 KiB), less each layer's miss slot
    assert snap.misses > 0 and snap.evictions > 0 and snap.loaded_mib > snap.all_experts_mib
    assert tokens == plain_tokens
    # the live LRU counts are what replaying the recorded trace through the same policy gives
    assert snap.lru_replay_hit_rate == snap.hit_rate
    assert snap.hit_rate <= snap.oracle_hit_rate < 1.0
    assert all(layer.hits + layer.misses > 0 for layer in snap.layers[:2])


def test_small_expert_cache_with_mtp_is_lossless(moe_ckpt, prompts, plain_tokens):
    tokens, snap, _ = _run(moe_ckpt, prompts, expert_cache_mib=1, batch_mtp=True, mtp_depth=2)
    assert tokens == plain_tokens
    assert snap.layers[2].hits + snap.layers[2].misses > 0  # the MTP block's experts are cached too


def test_captured_path_misses_are_rerun_between_steps(moe_ckpt, prompts, plain_tokens):
    # The graph-safe path (device slot table, miss counters) run eagerly on CPU: every step takes it, a miss
    # is detected between steps and the step runs again on the eager path, which loads what was missing.
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, expert_cache_mib=1)
        cache = engine.lm.model.expert_provider
        cache.capturing = lambda x: True
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            snap = cache.snapshot()
        finally:
            engine.close()
    assert tokens == plain_tokens
    assert snap.replays > 0 and snap.reruns > 0  # missed layers loaded and replayed; streaming layers re-run
    assert snap.reruns < snap.steps  # some steps hit everywhere, or were fixed by replays
    assert snap.lru_replay_hit_rate == snap.hit_rate  # the offline replay still gives the live counts


def test_books_shrink_the_cache_on_request_and_it_regrows(moe_ckpt, prompts, plain_tokens):
    from engine.telemetry import EventBus

    bus = EventBus()
    with one_thread():
        engine = make_engine(moe_ckpt, bus=bus, batch=3, tier_budget_mib=0.0)
        cache = engine.lm.model.expert_provider
        try:
            before = cache.mib
            freed = engine.budget.make_room(1.0, "graph decode out of memory")  # the tier has nothing to give
            assert freed >= 1.0 and cache.mib == before - freed and cache.slots < 16
            assert engine.budget.breakdown().experts_mib == round(cache.mib, 1)
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            assert cache.grow(100.0, "room again") > 0 and cache.slots == 16
        finally:
            engine.close()
    assert tokens == plain_tokens
    events = [e for e in bus.history() if e.type == "expert"]
    shrink = next(e for e in events if e.action == "shrink")
    assert shrink.reason == "graph decode out of memory" and shrink.mib == round(freed, 3)
    assert any(e.action == "grow" and e.reason == "room again" for e in events)
    assert any(e.action == "load" and e.experts > 0 and e.mib > 0 for e in events)


def test_expert_cache_option_errors_name_the_option(moe_ckpt, make_checkpoint):
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="expert_cache_mib='lots'.*auto"):
        make_engine(moe_ckpt, expert_cache_mib="lots")
    dense = make_checkpoint(size="tiny")
    with pytest.raises(ConfigError, match="expert_cache_mib=64.*no MoE layers"):
        make_engine(dense, expert_cache_mib=64)


def test_state_trace_and_prometheus_series(moe_ckpt, prompts, tmp_path):
    from engine.api import Health, HealthStatus
    from engine.exec.experts.trace import read_trace, replay
    from engine.server.expert_metrics import expert_metric_families
    from engine.server.metrics import ServerMetrics
    from engine.snapshot import EngineSnapshot

    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, expert_cache_mib=1)
        engine.kv.fused_prefill = True  # prompt chunks take the runner's own eager executor, as on CUDA
        try:
            run_all(engine, prompts, GREEDY)
            state = engine.state().to_json()
            cache = engine.lm.model.expert_provider
            cache.stats.write_trace(str(tmp_path / "trace.jsonl"), {"top_k": cache.top_k, "model": str(moe_ckpt)})
        finally:
            engine.close()
    snap = state["experts"]
    header, accesses = read_trace(tmp_path / "trace.jsonl")
    # padded rows of a prompt chunk's bucket route too but load nothing and are not counted
    prefill_tokens = sum(a.tokens for a in accesses if a.kind == "prefill" and a.layer == 0)
    assert prefill_tokens == sum(len(p) for p in prompts)  # not the chunk buckets
    assert {a.kind for a in accesses} == {"prefill", "decode"}
    assert header["num_experts"] == 16 and len(accesses) == snap["trace_accesses"] > 0
    replayed = replay(accesses, snap["slots"], "lru")  # offline, the same policy: the live counts exactly
    assert [list(replayed.get(i, (0, 0))) for i in range(3)] == [[layer["hits"], layer["misses"]] for layer in snap["layers"]]

    class _Published:  # the server reads the engine's published snapshot; this one was taken above
        def state(self):
            return EngineSnapshot.from_json(state)

        def health(self):
            return Health(HealthStatus.READY)

    text = ServerMetrics(_Published()).render().decode()  # what GET /metrics answers
    assert f'strata_expert_misses_total{{layer="0"}} {float(snap["layers"][0]["misses"])}' in text
    assert 'strata_expert_hit_rate{kind="oracle"}' in text and "strata_expert_cache_slots 6.0" in text
    assert list(expert_metric_families(None)) == []


def engine_whose_captures_run_out_of_memory(moe_ckpt, bus):
    """An engine on the graph cache's CPU backend whose first two decode captures run out of memory (injected):
    recovery asks the VRAM books for room, and the tier (empty) has none, so the expert cache answers."""
    from tests.fault_injection import FaultPlan
    from engine.exec.graphs.backends import CpuGraphBackend
    from engine.exec.graphs.cache import GraphCache
    from engine.switches import SwitchBoard

    holder = {}
    graphs = GraphCache("cpu", bus, SwitchBoard.from_values({}), wait_interval_s=0.0, backend=CpuGraphBackend(),
                        release_tier=lambda mib, reason: holder["engine"].budget.make_room(mib, reason),
                        fault_plan=FaultPlan.parse("capture:decode:1-2:oom"))
    holder["engine"] = make_engine(moe_ckpt, bus=bus, batch=3, executor=graphs, tier_budget_mib=0.0)
    return holder["engine"]


def test_graph_capture_oom_asks_the_expert_cache_through_the_books(moe_ckpt, prompts, plain_tokens):
    # The expert cache shrinks, the capture is retried, and the tokens do not change.
    from engine.telemetry import EventBus

    bus = EventBus()
    with one_thread():
        engine = engine_whose_captures_run_out_of_memory(moe_ckpt, bus)
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
        finally:
            engine.close()
    events = [(e.type, e.action) for e in bus.history() if e.type in ("graph", "expert")]
    shrink = next(e for e in bus.history() if e.type == "expert" and e.action == "shrink")
    assert "out of memory" in shrink.reason and shrink.slots < 16
    assert events.index(("expert", "shrink")) < events.index(("graph", "wait"))  # asked while waiting for room
    assert ("graph", "degrade") not in events
    assert tokens == plain_tokens


def test_auto_budget_takes_what_the_books_leave_and_the_cli_accepts_it(moe_ckpt):
    import argparse

    from engine.config import add_engine_options, config_from_args
    from engine.telemetry import EventBus

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert config_from_args(parser.parse_args(["--expert-cache-mib", "auto"])).expert_cache_mib == "auto"
    assert config_from_args(parser.parse_args(["--expert-cache-mib", "300"])).expert_cache_mib == 300
    bus = EventBus()
    with one_thread():
        engine = make_engine(moe_ckpt, bus=bus, expert_cache_mib="auto")
        try:
            cache = engine.lm.model.expert_provider
            assert cache.slots == cache.target_slots == 16  # host RAM on CPU: room for every expert
        finally:
            engine.close()
    assert any(e.type == "expert" and e.action == "grow" and e.reason.startswith("auto") for e in bus.history())


def test_expert_lfu_switch_gives_the_all_resident_tokens_and_its_own_counts(moe_ckpt, prompts, plain_tokens):
    from engine.telemetry import EventBus

    bus = EventBus()
    with one_thread():
        engine = make_engine(moe_ckpt, bus=bus, batch=3, expert_cache_mib=1, switches={"EXPERT_LFU": True})
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            cache = engine.lm.model.expert_provider
            snap, trace = cache.snapshot(), list(cache.stats.trace)
            live = [set(pool.policy.where) for pool in cache.pools]
        finally:
            engine.close()
    assert tokens == plain_tokens
    assert snap.policy == "lfu" and snap.misses > 0 and snap.evictions > 0
    assert snap.lfu_replay_hit_rate == snap.hit_rate  # the live counts are LRFU's on the recorded trace
    # and so are the experts left resident, which LRU would have evicted differently
    assert live == [_residents_after(trace, layer, snap.slots, "lfu") for layer in range(3)]
    assert live != [_residents_after(trace, layer, snap.slots, "lru") for layer in range(3)]
    assert any(e.type == "expert" and e.action == "evict" and e.reason == "lfu" for e in bus.history())


def test_expert_lfu_switch_toggles_live_without_moving_an_expert(moe_ckpt, prompts, plain_tokens):
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, expert_cache_mib=1)
        cache = engine.lm.model.expert_provider
        try:
            run_all(engine, prompts[:1], GREEDY, prefix="warm")
            residents = [dict(pool.policy.where) for pool in cache.pools]
            assert cache.policy == "lru" and engine.set_switch("EXPERT_LFU", True).enabled
            assert cache.snapshot().policy == "lfu"  # at once, before the next step
            assert [dict(pool.policy.where) for pool in cache.pools] == residents
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            assert cache.policy == "lfu"
            assert not engine.set_switch("EXPERT_LFU", False).enabled and cache.policy == "lru"
            assert {s["name"]: s["enabled"] for s in engine.board.snapshot()}["EXPERT_LFU"] is False
        finally:
            engine.close()
    assert tokens == plain_tokens


def _residents_after(trace, layer, slots, policy):
    from engine.exec.experts.trace import groups_of, make_policy

    pol = make_policy(policy, slots)
    for access in trace:
        if access.layer == layer:
            for group in groups_of(access.experts, slots):
                pol.serve(group)
    return set(pol.where)


def test_expert_store_on_a_peer_device_gives_the_all_resident_tokens(moe_ckpt, prompts, plain_tokens, monkeypatch):
    # --peer-device needs a second CUDA card (test_moe_gpu.py runs it there); on CPU the "peer" is the CPU
    # itself: the store is built on it as on a card (not pinned, counted as peer memory) and misses copy from it
    import torch

    import engine.exec.experts.setup as setup

    real = setup.start_expert_cache
    monkeypatch.setattr(setup, "start_expert_cache",
                        lambda *a, **kw: real(*a[:6], peer=torch.device("cpu"), peer_free_mib=0.0))
    tokens, snap, _ = _run(moe_ckpt, prompts, expert_cache_mib=1)
    assert tokens == plain_tokens
    assert snap.store_device == "cpu" and snap.host_mib == 0.0
    assert snap.peer_mib == snap.all_experts_mib and snap.misses > 0 and snap.loaded_mib > 0


def test_a_peer_without_room_for_the_expert_store_is_refused_before_allocating(moe_ckpt):
    import torch

    from engine.errors import ConfigError
    from engine.exec.experts.setup import start_expert_cache, store_mib
    from engine.model import load_checkpoint
    from engine.telemetry import EventBus

    lm = load_checkpoint(moe_ckpt, dtype="float32", device="cpu", expert_device="cpu", tokenizer=False)
    need = store_mib(lm.model)
    assert need == pytest.approx(3 * 16 * 3 * 64 * 64 * 4 / 2**20)  # 3 sparse layers x 16 experts x 3 matrices
    with pytest.raises(ConfigError, match=r"peer_device='cuda:1'.*experts need 2 MiB there but only 0 MiB"):
        start_expert_cache(None, lm.model, torch.device("cpu"), EventBus(), 1e6, 1024.0,
                           peer=torch.device("cuda:1"), peer_free_mib=1024.0)
    assert len(lm.model.layers[0].mlp.experts) == 16  # nothing was taken from the model


def test_torch_compile_traces_none_of_the_expert_cache(moe_ckpt):
    """Under COMPILE, Dynamo must not trace the expert cache: it would specialize on `capturing()` (False at the
    warm-up) and compile the captured branch during the CUDA graph capture itself, which CUDA refuses (so a MoE
    engine under COMPILE loses COMPILE or exits). The graphs Dynamo hands its backend hold the
    router but no operation from engine/exec/experts/cache.py, and the compiled block still computes the same."""
    import torch

    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, expert_cache_mib=1)
        try:
            block = next(m for m in engine.lm.model.modules() if getattr(m, "_provider", None))
            traced_from: list[str] = []

            def record(gm, example_inputs):
                traced_from.extend(node.meta.get("stack_trace") or "" for node in gm.graph.nodes)
                return gm

            x = torch.randn(1, 4, engine.lm.config.hidden_size, generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                compiled = torch.compile(block, backend=record)(x)
                eager = block(x)
        finally:
            engine.close()
            torch._dynamo.reset()
    assert any("moe.py" in trace for trace in traced_from), "Dynamo traced nothing: the test proves nothing"
    assert not [trace for trace in traced_from if "expert_cache.py" in trace]
    assert torch.equal(compiled, eager)
