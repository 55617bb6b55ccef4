"""`strata-engine bench experts` end to end on CPU (a tiny random MoE): every budget row, the same greedy tokens,
hit rates that fall with the budget, the trace file, and a dense model refused by name."""

from __future__ import annotations

import json

import pytest

from engine.cli import main


def test_bench_experts_runs_every_budget(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setenv("STRATA_BENCH_CACHE", str(tmp_path / "ckpts"))
    out, trace = tmp_path / "experts.json", tmp_path / "trace.jsonl"
    code = main(["bench", "experts", "--model", "random:moe-small", "--device", "cpu", "--budgets", "10,50",
                 "--prompt-tokens", "16", "--new-tokens", "12", "--no-hf", "--json", str(out), "--trace-out", str(trace),
                 "--copy-mib", "8"])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = {r["budget_pct"]: r for r in doc["rows"]}
    # the floor: the dense weights plus the step's distinct experts over the measured copy bandwidth; no run
    # reaches it (a CPU step is bound by its launches)
    assert all(r["floor_tok_s"] > 0 and 0 < r["of_floor"] < 1 for r in doc["rows"])
    assert sorted(rows) == [10, 50, 100]
    assert rows[100]["slots"] == 32 and rows[100]["misses"] == 0 and rows[100]["hit_rate"] == 1.0
    assert rows[50]["slots"] == 16 and rows[10]["slots"] == 3
    assert all(r["same_tokens"] for r in doc["rows"]) and {r["store"] for r in doc["rows"]} == {"host"}
    assert rows[10]["hit_rate"] < rows[50]["hit_rate"] < 1.0 and rows[10]["misses"] > 0
    assert rows[10]["hit_rate"] <= rows[10]["oracle_hit_rate"]
    assert json.loads(trace.read_text().splitlines()[0])["slots"] == 3


def test_bench_experts_refuses_a_dense_model_and_a_peer_store_without_a_peer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_BENCH_CACHE", str(tmp_path / "ckpts"))
    code = main(["bench", "experts", "--model", "random:tiny", "--device", "cpu", "--json", str(tmp_path / "x.json")])
    assert code == 2
    assert "not a mixture-of-experts checkpoint" in capsys.readouterr().err
    code = main(["bench", "experts", "--model", "random:moe-small", "--device", "cpu", "--kernels", "1,6",
                 "--json", str(tmp_path / "x.json")])
    assert code == 2
    assert "timed on CUDA" in capsys.readouterr().err
    code = main(["bench", "experts", "--model", "random:moe-small", "--device", "cpu", "--stores", "host,peer",
                 "--json", str(tmp_path / "x.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "stores='host,peer'" in err and "needs --peer-device cuda:N" in err


def test_bench_experts_replay_synthetic_and_a_recorded_trace(tmp_path, capsys):
    from engine.bench.expert_traces import synthetic_trace
    from engine.exec.experts.trace import hit_rate, replay, write_trace

    out = tmp_path / "replay.json"
    small = ["--layers", "2", "--experts", "32", "--top-k", "4", "--steps", "400", "--seed", "3"]
    assert main(["bench", "experts-replay", "--budgets", "15,50", "--json", str(out), *small]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["trace"], r["budget_pct"]): r for r in doc["rows"]}
    assert sorted(rows) == [("skewed", 15), ("skewed", 50), ("uniform", 15), ("uniform", 50)]
    skewed = synthetic_trace("skewed", 2, 32, 4, 400, seed=3)
    assert rows[("skewed", 15)]["slots"] == 5 and rows[("skewed", 15)]["lru"] == hit_rate(replay(skewed, 5, "lru"))
    for r in doc["rows"]:
        assert r["lru"] <= r["belady"] and r["lfu"] <= r["belady"]
    assert doc["summary"]["lfu_beats_lru_on"] == ["skewed"]
    # a recorded trace file (what `bench experts --trace-out` or a real model writes) replays the same way
    path = write_trace(tmp_path / "t.jsonl", {"num_layers": 2, "num_experts": 32, "top_k": 4}, skewed)
    assert main(["bench", "experts-replay", "--trace", str(path), "--budgets", "15", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["lfu"] == rows[("skewed", 15)]["lfu"] and row["accesses"] == len(skewed)
    capsys.readouterr()
    assert main(["bench", "experts-replay", "--policies", "lru,fifo", "--json", str(out)]) == 2
    assert "policies='lru,fifo'" in capsys.readouterr().err
    assert main(["bench", "experts-replay", "--trace", str(tmp_path / "none.jsonl"), "--json", str(out)]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    assert main(["bench", "experts-replay", "--half-life", "0", "--json", str(out)]) == 2
    assert "half_life=0.0: expected at least 0.01" in capsys.readouterr().err


def test_bench_experts_on_a_synthetic_skewed_source(tmp_path, one_torch_thread):
    # random:moe-synth-tiny has no file (engine.model.synthetic) and a skewed router: with part of the experts on
    # the device the live LRU hits well above the resident fraction (a uniform router's rate), and is compared
    # with Belady on the same trace
    out = tmp_path / "experts.json"
    code = main(["bench", "experts", "--model", "random:moe-synth-tiny", "--device", "cpu", "--copy-mib", "8", "--budgets", "25",
                 "--prompt-tokens", "24", "--new-tokens", "16", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = {r["budget_pct"]: r for r in doc["rows"]}
    assert sorted(rows) == [25, 100] and all(r["engine"] == "strata" for r in doc["rows"])  # no transformers peer
    small = rows[25]
    assert all(r["same_tokens"] for r in doc["rows"]) and small["slots"] < 16 and small["misses"] > 0
    assert small["hit_rate"] > small["slots"] / 16 + 0.1
    assert rows[25]["vs_belady"] == pytest.approx(rows[25]["hit_rate"] / rows[25]["oracle_hit_rate"])
    assert 0 < rows[25]["vs_belady"] <= 1.0


def test_bench_experts_runs_the_three_cold_paths_side_by_side(tmp_path, one_torch_thread):
    # one run: every cold-expert mode at the budget below 100 %, batches 1 and 2, the 100 % row from another model
    # (as random:moe-80b is compared with random:moe-80b-40l, whose experts all fit the card)
    out = tmp_path / "cold.json"
    code = main(["bench", "experts", "--model", "random:moe-synth-tiny", "--device", "cpu", "--copy-mib", "8", "--budgets", "50",
                 "--cold", "copy,cpu,prefetch", "--batches", "1,2", "--all-resident-model", "random:moe-small",
                 "--prompt-tokens", "16", "--new-tokens", "8", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["summary"]["all_same_tokens"]
    assert [(r["batch"], r["budget_pct"], r["cold"]) for r in rows] == [
        (b, p, c) for b in (1, 2) for p, c in ((100, "copy"), (50, "copy"), (50, "cpu"), (50, "prefetch"))]
    for r in rows:
        if r["budget_pct"] == 100:
            assert r["model"] == "random:moe-small" and r["misses"] == 0 and r["same_tokens"] is None
        else:
            assert r["model"] == "random:moe-synth-tiny" and r["same_tokens"] and r["hit_rate"] < 1.0
            assert r["vs_all_resident"] is not None and (r["prefetched"] > 0) == (r["cold"] == "prefetch")


def test_bench_experts_refuses_an_unknown_cold_mode(tmp_path, capsys):
    code = main(["bench", "experts", "--model", "random:moe-synth-tiny", "--device", "cpu", "--cold", "copy,disk",
                 "--json", str(tmp_path / "x.json")])
    assert code == 2
    assert "cold='copy,disk'" in capsys.readouterr().err


def test_bench_experts_reports_the_mib_a_prompt_copies_with_and_without_windows(tmp_path, one_torch_thread):
    # prompts of six chunks at a budget of half the experts: chunk by chunk (--prefill-window-tokens 0) each
    # chunk copies its cold experts in again; the default window covers the prompt, so each crosses once
    def row(*extra):
        out = tmp_path / "prompt.json"
        code = main(["bench", "experts", "--model", "random:moe-synth-tiny", "--device", "cpu", "--copy-mib", "8",
                     "--budgets", "50", "--prompt-tokens", "96", "--new-tokens", "4", "--prefill-chunk-tokens", "16",
                     "--step-token-budget", "16", "--json", str(out), *extra])
        assert code == 0
        rows = {r["budget_pct"]: r for r in json.loads(out.read_text())["rows"]}
        assert rows[100]["prompt_loaded_mib"] == 0 and all(r["same_tokens"] for r in rows.values())
        return rows[50]

    chunked, windowed = row("--prefill-window-tokens", "0"), row()
    assert chunked["prefill_window_tokens"] == 0 and windowed["prefill_window_tokens"] > 96
    assert 0 < windowed["prompt_loaded_mib"] < chunked["prompt_loaded_mib"]
    assert "prompt_loaded_mib" in (tmp_path / "prompt.json").read_text()



def test_bench_experts_sizes_its_budgets_by_the_int4_experts_bytes(tmp_path, monkeypatch, one_torch_thread):
    """`--quantize int4` on a checkpoint: the experts stay 4-bit in the cache, so a budget's percent of their
    bytes buys about that percent of the slots (the bench rounds a budget up to whole MiB; sized by a 16-bit
    expert it would buy every slot), with the all-resident tokens."""
    from engine.bench.experts import slots_for_pct

    monkeypatch.setenv("STRATA_BENCH_CACHE", str(tmp_path / "ckpts"))
    out = tmp_path / "int4.json"
    code = main(["bench", "experts", "--model", "random:moe-small", "--device", "cpu", "--quantize", "int4",
                 "--budgets", "50", "--prompt-tokens", "16", "--new-tokens", "8", "--no-hf", "--copy-mib", "8",
                 "--json", str(out)])
    assert code == 0
    rows = {r["budget_pct"]: r for r in json.loads(out.read_text())["rows"]}
    want = slots_for_pct(50, 32)
    assert want <= rows[50]["slots"] <= want + 4 and rows[50]["misses"] > 0
    assert rows[50]["same_tokens"] and rows[100]["misses"] == 0 and rows[100]["slots"] == 32
