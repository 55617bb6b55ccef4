"""Routing traces and slot policies (pure Python): LRU and Belady by hand, groups, the file format, replay."""

from __future__ import annotations

import random

import pytest

from engine.exec.experts.trace import Access, SlotPolicy, groups_of, hit_rate, main, read_trace, replay, write_trace


def _seq(*groups):
    return [Access(step=i, layer=0, experts=tuple(g)) for i, g in enumerate(groups)]


def test_lru_and_belady_by_hand():
    seq = _seq([0, 1], [2], [0])
    assert replay(seq, 2, "lru") == {0: (0, 4)}  # 2 evicts 0 (least recent), 0 then evicts 1
    assert replay(seq, 2, "belady") == {0: (1, 3)}  # 2 evicts 1 (never used again), 0 hits


def test_an_access_larger_than_the_pool_streams_in_groups():
    assert groups_of([5, 1, 3, 1, 9], 2) == [[1, 3], [5, 9]]
    policy = SlotPolicy(2)
    first = policy.serve([1, 3])
    second = policy.serve([5, 9])
    assert first.loads == [(1, 0), (3, 1)] and second.evicted == [1, 3] and set(policy.where) == {5, 9}
    with pytest.raises(AssertionError, match="group of 3 experts for 2 slots"):
        policy.serve([1, 2, 3])


def test_resize_keeps_the_most_recently_used():
    policy = SlotPolicy(4)
    for g in ([0], [1], [2], [3], [1]):
        policy.serve(g)
    kept = policy.resize(2)
    assert set(kept) == {3, 1} and sorted(policy.where.values()) == [0, 1]
    assert policy.serve([7]).evicted == [3]  # 3 is now the least recently used


def test_belady_is_never_worse_than_lru_on_random_traces():
    rng = random.Random(0)
    for _ in range(20):
        seq = [Access(t, rng.randrange(2), tuple(rng.sample(range(12), 3))) for t in range(200)]
        for slots in (2, 3, 6):
            assert hit_rate(replay(seq, slots, "belady")) >= hit_rate(replay(seq, slots, "lru"))


def test_trace_file_round_trip_and_replay_cli(tmp_path, capsys):
    seq = _seq([0, 1], [2], [0])
    path = write_trace(tmp_path / "t.jsonl", {"num_layers": 1, "num_experts": 3, "top_k": 2}, seq)
    header, back = read_trace(path)
    assert header["format"] == "strata-expert-trace" and header["num_experts"] == 3
    assert back == [Access(a.step, a.layer, a.experts, 0, "") for a in seq]
    assert main([str(path), "--slots", "2"]) == 0
    assert "slots     2: lru 0.0  lfu 0.0  belady 0.25" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text(path.read_text() + '{"step": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:5: not a trace access line"):
        read_trace(tmp_path / "bad.jsonl")
    assert main([str(tmp_path / "missing.jsonl")]) == 2


def test_a_paced_snapshot_reuses_a_recent_oracle_and_a_fresh_one_replays_the_trace(monkeypatch):
    """The oracle replays the whole trace in Python: snapshots published while steps run must not redo it."""
    import engine.exec.experts.stats as stats_mod
    from engine.exec.experts.stats import ExpertStats
    from engine.telemetry import EventBus

    stats = ExpertStats(num_layers=1, num_experts=8, bus=EventBus(), device="cpu")
    replays: list[str] = []
    real_replay = stats_mod.replay
    monkeypatch.setattr(stats_mod, "replay", lambda *a, **kw: replays.append(a[2]) or real_replay(*a, **kw))
    for step in range(20):
        stats.begin_step("decode")
        stats.record_access(0, [step % 5, (step + 2) % 8], tokens=1)
    first = stats.snapshot(oracle_max_age_s=60.0, slots=2)
    assert replays == ["belady", "lru"] and first.oracle_hit_rate is not None
    stats.begin_step("decode")
    stats.record_access(0, [7, 6], tokens=1)
    assert stats.snapshot(oracle_max_age_s=60.0, slots=2).oracle_hit_rate == first.oracle_hit_rate
    assert len(replays) == 2  # paced: the recent replay is reused
    stats.snapshot(oracle_max_age_s=0.0, slots=2)
    assert len(replays) == 4  # fresh (Engine.state): the trace changed, so it is replayed again
    stats.snapshot(oracle_max_age_s=0.0, slots=2)
    assert len(replays) == 4  # nothing changed since: the last replay stands


def test_lfu_keeps_the_often_used_expert_that_lru_evicts():
    from engine.exec.experts.trace import FrequencyPolicy

    seq = _seq([0], [0], [0], [1], [2], [0])
    assert replay(seq, 2, "lru") == {0: (2, 4)}  # 2 evicts 0 (least recent), so 0 misses again
    assert replay(seq, 2, "lfu") == {0: (3, 3)}  # 2 evicts 1 (used once), 0 hits
    policy = FrequencyPolicy(2)
    for g in ([0], [0], [0], [1]):
        policy.serve(g)
    result = policy.serve([2])
    assert result.evicted == [1] and result.loads == [(2, 1)] and policy.serve([0]).hits == 1


def test_lfu_counts_decay_so_a_burst_long_ago_loses_to_recent_use():
    from engine.exec.experts.trace import FrequencyPolicy

    old_burst = [[0]] * 15 + [[1], [2]] * 10  # 0 used 15 times long ago, 1 and 2 ten times each since
    for half_life, evicted in ((2.0, 0), (1e9, 1)):  # a short half-life forgets the burst; a huge one is plain LFU
        policy = FrequencyPolicy(3, half_life)
        for g in old_burst:
            policy.serve(g)
        assert policy.serve([3]).evicted == [evicted], half_life


def test_lfu_ties_fall_back_to_recency_and_tiny_half_lives_do_not_overflow():
    from engine.exec.experts.trace import FrequencyPolicy

    policy = FrequencyPolicy(2)
    policy.serve([4])
    policy.serve([5])
    assert policy.serve([6]).evicted == [4]  # equal counts: the least recently used goes
    tiny = FrequencyPolicy(2, half_life=0.01)  # the weight doubles 100 times per group: rescaled, never inf
    rng = random.Random(1)
    seq = [[rng.randrange(6)] for _ in range(500)]
    for g in seq:
        tiny.serve(g)
    assert all(v < float("inf") for v in tiny.score.values())
    with pytest.raises(ValueError, match="half_life=0: expected at least 0.01"):
        FrequencyPolicy(2, half_life=0)
    # with so short a half-life the last use dominates: exactly LRU's counts
    assert replay(_seq(*seq), 2, "lfu", half_life=0.01) == replay(_seq(*seq), 2, "lru")


def test_lfu_resize_keeps_the_most_used_and_adopt_moves_no_expert():
    from engine.exec.experts.trace import FrequencyPolicy, adopt

    policy = FrequencyPolicy(4)
    for g in ([0], [0], [1], [2], [2], [2], [3]):
        policy.serve(g)
    kept = policy.resize(2)
    assert set(kept) == {0, 2} and sorted(policy.where.values()) == [0, 1]
    lru = SlotPolicy(3)
    for g in ([7], [8], [9]):
        lru.serve(g)
    lfu = adopt(lru, "lfu")
    assert lfu.name == "lfu" and dict(lfu.where) == dict(lru.where) and adopt(lfu, "lfu") is lfu
    assert adopt(lfu, "lru").name == "lru" and adopt(lfu, "lru").serve([1]).evicted == [7]
    with pytest.raises(ValueError, match="expected one of lru, lfu"):
        adopt(lru, "belady")


def test_lfu_beats_lru_on_a_skewed_trace_and_ties_on_a_uniform_one():
    from engine.bench.expert_traces import synthetic_trace

    skewed = synthetic_trace("skewed", layers=2, experts=32, top_k=4, steps=600, seed=3)
    uniform = synthetic_trace("uniform", layers=2, experts=32, top_k=4, steps=600, seed=3)
    assert skewed == synthetic_trace("skewed", layers=2, experts=32, top_k=4, steps=600, seed=3)  # seeded
    assert hit_rate(replay(skewed, 8, "lfu")) > hit_rate(replay(skewed, 8, "lru")) + 0.02
    assert abs(hit_rate(replay(uniform, 8, "lfu")) - hit_rate(replay(uniform, 8, "lru"))) < 0.02
    for seq in (skewed, uniform):
        assert hit_rate(replay(seq, 8, "belady")) >= hit_rate(replay(seq, 8, "lfu"))
