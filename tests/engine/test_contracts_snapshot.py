"""The typed /strata/state snapshot: what a real engine publishes, and its JSON round trip (engine.snapshot)."""

from __future__ import annotations

import threading

import pytest

from engine.api import HealthStatus, SamplingParams
from engine.snapshot import EngineSnapshot
from tests.engine.engine_helpers import make_engine, random_prompts, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_real_engine_publishes_a_snapshot_with_draft_totals_per_position(ckpt):
    engine = make_engine(ckpt, batch=2, batch_mtp=True, mtp_depth=2)
    run_all(engine, random_prompts(2, seed=8, lengths=(40, 60)),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert isinstance(engine.state(), EngineSnapshot)  # typed to the wire: the server calls to_json once
    data = engine.state().to_json()
    snap = EngineSnapshot.from_json(data)
    assert snap.to_json() == data  # the wire form survives a parse by a reader (the TUI, the metrics)
    assert snap.health.status is HealthStatus.READY and snap.mtp.enabled and snap.mtp.depth == 2
    assert len(snap.mtp.draft_proposed) == 2 and snap.mtp.draft_proposed[0] > 0
    assert snap.mtp.draft_proposed[0] >= snap.mtp.draft_accepted[0] >= snap.mtp.draft_accepted[1]
    assert [s.state for s in snap.slots] == ["idle", "idle"] and snap.queue.prefill_tokens == 0
    assert snap.kv is not None and snap.kv.mib > 0 and snap.vram[0].weights_mib > 0


def test_the_queue_reports_prompt_tokens_still_to_prefill(ckpt):
    engine = make_engine(ckpt, batch=1, prefill_chunk_tokens=64, step_token_budget=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5] * 200, params)
    engine.add_request("b", [6] * 30, params)
    assert engine.state().to_json()["queue"]["prefill_tokens"] == 230
    engine.step()  # "a" takes the slot and prefills its first chunk
    snap = EngineSnapshot.from_json(engine.state().to_json())
    assert snap.queue.waiting == 1 and snap.queue.prefill_tokens == 230 - snap.slots[0].prefilled_tokens


def test_readers_on_other_threads_get_the_published_snapshot_not_live_state(ckpt):
    engine = make_engine(ckpt, batch=1)
    published = engine.snapshot
    seen: list[EngineSnapshot] = []
    reader = threading.Thread(target=lambda: seen.append(engine.snapshot))
    engine.add_request("a", [5] * 20, SamplingParams(max_tokens=2, temperature=0.0))  # not yet published
    reader.start()
    reader.join()
    assert seen[0] is published and seen[0].queue.waiting == 0


def test_an_older_engines_health_text_still_parses():
    old = {"model": "m", "health": {"ready": False, "reason": "dead: CUDA error: an illegal memory access"}}
    assert EngineSnapshot.from_json(old).health.status is HealthStatus.DEAD
    assert EngineSnapshot.from_json({"health": {"status": "ready"}}).health.status is HealthStatus.READY


def test_publishing_again_resolves_no_annotations(ckpt, monkeypatch):
    """The engine thread publishes a snapshot between decode steps many times a second: each class's annotations are
    resolved once (typing.get_type_hints compiles and evaluates every string annotation on each call), and a
    second publish resolves none."""
    import typing

    import engine.snapshot as snapshot

    engine = make_engine(ckpt, batch=2)
    calls: list[type] = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda cls, *a, **kw: calls.append(cls) or real(cls, *a, **kw))
    snapshot._hints.cache_clear()
    engine.publish_snapshot(force=True)
    first = list(calls)
    assert first and len(first) == len(set(first)), first
    engine.publish_snapshot(force=True)
    assert calls == first, "a second publish resolved annotations again"
    data = engine.state().to_json()
    assert EngineSnapshot.from_json(data).to_json() == data  # the cached hints parse as before


# The `experts` section's keys on the wire (the TUI, the Prometheus series and scripts read them by name).
_EXPERT_KEYS = {"slots", "target_slots", "mib", "host_mib", "peer_mib", "store_device", "expert_mib",
                "all_experts_mib", "top_k", "cold", "num_layers", "num_experts", "policy", "device", "hits", "misses",
                "hit_rate", "evictions", "loaded_experts", "loaded_mib", "prompt_loaded_experts",
                "prompt_loaded_mib", "load_ms", "reruns", "replays", "prefetched",
                "host_runs", "steps", "trace_accesses", "layers", "oracle_hit_rate", "lru_replay_hit_rate"}


def _expert_stats_snapshot(policy: str):
    from engine.exec.experts.stats import ExpertStats
    from engine.telemetry import EventBus

    stats = ExpertStats(num_layers=2, num_experts=4, bus=EventBus(), device="cpu")
    for step in range(3):
        stats.begin_step("decode")
        for layer in range(2):
            stats.record_access(layer, [step % 4, (step + 1) % 4], tokens=1)
    stats.hits, stats.misses, stats.evictions = [3, 0], [1, 0], [1, 0]
    return stats.snapshot(0.0, policy=policy, slots=2, target_slots=3, mib=1.23456789, host_mib=9.0, peer_mib=0.0,
                          store_device="host", expert_mib=0.1875, all_experts_mib=1.5, top_k=2, cold="copy")


def test_the_expert_cache_snapshot_is_typed_and_sends_the_keys_it_always_sent():
    from engine.snapshot import ExpertCacheSnapshot, ExpertLayerSnapshot

    snap = _expert_stats_snapshot("lru")
    assert isinstance(snap, ExpertCacheSnapshot) and all(isinstance(x, ExpertLayerSnapshot) for x in snap.layers)
    assert (snap.hits, snap.misses, snap.hit_rate, snap.mib, snap.trace_accesses) == (3, 1, 0.75, 1.2346, 6)
    assert [(x.layer, x.hit_rate) for x in snap.layers] == [(0, 0.75), (1, None)]
    wire = snap.to_json()
    assert set(wire) == _EXPERT_KEYS  # no LFU replay while the live policy is LRU
    assert set(wire["layers"][0]) == {"layer", "hits", "misses", "evictions", "loaded", "prompt_loaded", "hit_rate"}
    assert ExpertCacheSnapshot.from_json(wire) == snap
    lfu = _expert_stats_snapshot("lfu").to_json()
    assert set(lfu) == _EXPERT_KEYS | {"lfu_replay_hit_rate"} and lfu["lfu_replay_hit_rate"] is not None
    parsed = EngineSnapshot.from_json({"experts": wire})
    assert parsed.experts == snap and EngineSnapshot.from_json({"experts": None}).experts is None
    assert parsed.to_json()["experts"] == wire
