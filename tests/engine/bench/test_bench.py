"""The engine benchmarks at tiny sizes on CPU: every code path runs and its JSON has sane fields.

No timing assertions: speed claims come from the benchmarks themselves (docs/BENCHMARKS.md). What is checked
is what could be wrong without being slow: counts of tokens, steps, rows and graphs, and the error paths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.bench import command as cli_bench
from engine.errors import ConfigError, UnknownSwitch

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--model", "random:tiny", "--device", "cpu"]


@pytest.fixture(scope="module", autouse=True)
def _checkpoint_cache_and_one_thread(tmp_path_factory: pytest.TempPathFactory):
    """One random checkpoint per shape for the whole module (the benches write it on first use), and one
    intra-op thread: on a shared 2-core CI box, spinning torch threads make tiny matmuls 10x slower."""
    import torch

    mp = pytest.MonkeyPatch()
    mp.setenv("STRATA_BENCH_CACHE", str(tmp_path_factory.mktemp("checkpoints")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


def bench(tmp_path: Path, argv: list[str], device: str = "cpu") -> dict[str, Any]:
    """Run one benchmark through the CLI's parser; return its JSON after checking the common fields."""
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    out = tmp_path / f"{argv[0]}.json"
    assert cli_bench.run(parser.parse_args([*argv, "--json", str(out)])) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == argv[0] and "partial" not in doc
    assert doc["env"]["torch"] and doc["env"]["device"] == device
    return doc


def test_decode_counts_every_token_and_reports_rates(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["decode", *TINY, "--batches", "1,3", "--prompt-tokens", "16", "--new-tokens", "9",
                           "--graph-modes", "off"])
    assert [(r["graphs"], r["batch"]) for r in doc["rows"]] == [("off", 1), ("off", 3)]
    for row in doc["rows"]:
        assert row["tokens"] == 9 * row["batch"]
        assert row["steps"] == 9  # one prefill step yields the first token, then one decode step per token
        assert row["decode_tok_s"] > 0 and row["tok_s"] > 0 and row["graphs_active"] is False
        assert math.isclose(row["per_slot_tok_s"] * row["batch"], row["decode_tok_s"])
    assert doc["summary"]["b1_decode_tok_s"] == doc["rows"][0]["decode_tok_s"]
    assert doc["params"]["new_tokens"] == 9


def test_ttft_prefills_in_chunks_and_each_prompt_is_fresh(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["ttft", *TINY, "--prompt-sizes", "200,100,200", "--prefill-chunk-tokens", "64",
                           "--step-token-budget", "64"])
    assert [r["prompt_tokens"] for r in doc["rows"]] == [100, 200, 200]  # a size given twice: measured twice
    assert [r["steps"] for r in doc["rows"]] == [math.ceil(100 / 64), math.ceil(200 / 64), math.ceil(200 / 64)]
    for row in doc["rows"]:
        assert row["ttft_s"] > 0 and math.isclose(row["prefill_tok_s"], row["prompt_tokens"] / row["ttft_s"])
        # where the time went: the chunks, the tier's fills, the rest of the steps (all of it measured)
        assert 0 < row["chunk_s"] < row["ttft_s"] and row["fill_s"] >= 0
        assert math.isclose(row["chunk_s"] + row["fill_s"] + row["other_s"], row["ttft_s"])
    assert set(doc["summary"]) == {"ttft_s_100", "ttft_s_200", "ttft_s_200_2"}


def test_reuse_serves_a_repeated_prompt_from_the_tier(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["reuse", *TINY, "--prompt-sizes", "600", "--prefill-chunk-tokens", "64",
                           "--step-token-budget", "64", "--pairs", "2"])
    copy, shared = doc["rows"]  # no --peer-device: the tier on the compute device, both ways it serves a prefix
    assert (copy["path"], shared["path"]) == ("copy", "shared")
    for row in (copy, shared):
        assert row["tier_device"] == "cpu" and row["prompt_tokens"] == 600
        assert 0 < row["cached_tokens"] < 600  # whole blocks from the tier; the tail is prefilled again
        assert row["reused_ttft_s"] < row["fresh_ttft_s"]
        assert math.isclose(row["reused_over_fresh"], row["reused_ttft_s"] / row["fresh_ttft_s"])
        # the reuse's time taken apart: its tail (the tokens past the last whole tier block) in one chunk, the rest
        assert row["reused_tail_tokens"] == 600 - row["cached_tokens"]
        assert 0 < row["reused_chunk_s"] < row["reused_ttft_s"]
        assert math.isclose(row["reused_chunk_s"] + row["reused_other_s"], row["reused_ttft_s"], abs_tol=1e-9)
        # two distinct prompts, each fresh then again; the row's figures are the last pair's
        assert len(row["fresh_ttft_s_each"]) == len(row["reused_ttft_s_each"]) == 2
        assert (row["fresh_ttft_s_each"][-1], row["reused_ttft_s_each"][-1]) == (row["fresh_ttft_s"],
                                                                                 row["reused_ttft_s"])
        # one more pair, its reuse under cProfile: the host functions with the most time, the step's among them
        assert 0 < row["reused_profiled_ttft_s"] and len(row["reused_host_cum_ms"]) == 25
        assert any(name.endswith(":step") for name in row["reused_host_cum_ms"])
    # SHARED_PREFIX on: the tier's blocks are in the KV pool, the reused prefix was mapped into the slot, not copied
    # (both pairs' prompts and the profiled one: three reuses of the same number of blocks)
    assert shared["shared_blocks"] == 3 * (shared["cached_tokens"] // 256) and shared["copied_blocks"] == 0
    assert copy["shared_blocks"] == 0 and copy["copied_blocks"] == 3 * (copy["cached_tokens"] // 256)
    assert set(doc["summary"]) == {"reused_over_fresh_600_copy", "reused_over_fresh_600_shared"}


def test_admission_measures_shorts_before_and_during_the_long_prefill(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["admission", *TINY, "--slots", "2", "--long-tokens", "256", "--short-prompt-tokens", "8",
                           "--baseline-steps", "3", "--warmup-steps", "1", "--prefill-chunk-tokens", "64",
                           "--step-token-budget", "128"])
    (row,) = doc["rows"]
    assert row["slots"] == 2 and row["long_tokens"] == 256 and row["shorts_finished_early"] == 0
    assert row["during_steps"] >= math.ceil(256 / 64)  # pacing may add decode-only steps  # every step decodes both shorts and prefills one chunk
    assert row["baseline_tok_s"] > 0 and row["during_tok_s"] > 0 and row["after_tok_s"] > 0
    assert math.isclose(row["decode_ratio_vs_before"], row["during_tok_s"] / row["baseline_tok_s"])
    # The ratio against the mean per-token time of before and after (the shorts' context grew meanwhile).
    alone = (1 / row["baseline_tok_s"] + 1 / row["after_tok_s"]) / 2
    assert math.isclose(row["decode_ratio"], row["during_tok_s"] * alone)
    assert doc["summary"]["worst_decode_ratio"] == row["decode_ratio"]
    # Graph and tier events per phase (none on an eager CPU engine with a host tier) and the degraded buckets.
    assert row["events_during"] == row["events_after"] == {} and row["degraded_graphs"] == []
    assert row["graph_errors"] == [] and row["during_event_step_s"] == 0.0
    assert 0 < row["after_step_ms_p50"] <= row["after_max_step_ms"]
    assert row["baseline_step_ms"] <= row["baseline_max_step_ms"] and row["max_step_ms"] > 0
    # The same prompt length alone first, on the same engine: the TTFT ratio in one run.
    assert 0 < row["alone_ttft_s"] <= row["alone_first_ttft_s"]  # two lone runs; the figure is the faster one
    assert [r["chunks"] for r in row["alone_runs"]] == [256 // 64] * 2  # unpaced: full chunks, one a step
    lone = row["alone_runs"]
    assert row["alone_first_ttft_s"] == lone[0]["ttft_s"] and row["alone_ttft_s"] == min(r["ttft_s"] for r in lone)
    assert all(0 < r["chunk_s"] <= r["ttft_s"] for r in lone)
    assert row["alone_ttft_s"] > 0 and math.isclose(row["ttft_vs_alone"], row["long_ttft_s"] / row["alone_ttft_s"])
    assert doc["summary"]["worst_ttft_vs_alone"] == row["ttft_vs_alone"]
    # Where the admission's time went, from the timings the engine gave its pacer: every prompt token in a chunk.
    assert row["during_chunks"] >= math.ceil(256 / 64) and row["chunk_tokens_max"] <= 64
    assert row["during_steps_with_chunk"] == row["during_chunks"]  # one prompt: at most one chunk a step
    # The longest step, taken apart: a stall names what it held (decode, a chunk, fills, graph or tier events).
    longest = row["max_step"]
    assert longest["ms"] == pytest.approx(row["max_step_ms"]) and 0 <= longest["step"] < row["during_steps"]
    assert longest["decode_rows"] == 2 and longest["chunk_tokens"] <= 64 and longest["events"] == []
    assert longest["decode_ms"] + longest["chunk_ms"] + longest["fill_ms"] <= longest["ms"]
    assert 0 < row["during_chunk_s"] < row["long_ttft_s"] and 0 < row["during_decode_s"] < row["long_ttft_s"]


def test_admission_with_chunks_beside_the_steps_reports_them_apart(tmp_path: Path) -> None:
    """`--prefill-overlap on` (a CPU: one stream, each chunk lands in the step that launched it): whole chunks, one in
    flight, those beside the steps reported apart; the lone runs (no slot decoding) run their chunks between steps."""
    doc = bench(tmp_path, ["admission", *TINY, "--slots", "2", "--long-tokens", "2048", "--short-prompt-tokens", "8",
                           "--baseline-steps", "3", "--warmup-steps", "1", "--prefill-chunk-tokens", "512",
                           "--step-token-budget", "1024", "--prefill-overlap", "on"])
    (row,) = doc["rows"]
    assert row["chunks_beside_steps"] is True
    # whole chunks. The lone runs measured what a chunk costs and the baseline what a decode step costs, so a chunk
    # goes beside the steps unless its predicted cost fits one step's allowance between them (timing). A 512-token
    # chunk of the tiny model costs several of its decode steps: a loaded machine's noise cannot make all fit.
    assert 1 <= row["during_chunks_beside"] <= row["during_chunks"] == 2048 // 512
    assert row["chunk_tokens_min"] == row["chunk_tokens_max"] == 512
    assert 0 < row["during_chunk_beside_s"] <= row["during_chunk_s"]
    assert row["during_steps"] >= 2048 // 512  # one chunk a step (a CPU's lands in the step that launched it)
    assert 0 < row["during_decode_beside_s"] <= row["during_decode_s"]
    assert [r["chunks"] for r in row["alone_runs"]] == [2048 // 512] * 2


def test_admission_event_counts_name_each_graph_and_tier_action() -> None:
    from engine.bench.admission import event_counts
    from engine.telemetry import GraphEvent, SlotEvent, TierEvent

    events = [GraphEvent(action="capture", kind="decode", key="b8 L4096"), TierEvent(action="shrink", mib=64.0),
              GraphEvent(action="capture", kind="decode", key="b8 L8192"), SlotEvent(slot=0, state="decode")]
    assert event_counts(events) == {"graph capture": 2, "tier shrink": 1}


def test_admission_takes_its_longest_step_apart_with_the_events_it_published() -> None:
    from engine.bench.admission import _longest_step
    from engine.core.chunk_cost import ChunkTiming
    from engine.core.prefill_pacer import StepTiming
    from engine.telemetry import GraphEvent, SlotEvent, TierEvent

    timings = [StepTiming(0.004, 6, [ChunkTiming(0, 256, 0.2)]), StepTiming(1.5, 6, []), StepTiming(0.004, 6, [])]
    events = [GraphEvent(action="capture", kind="decode", key="b8 L512"), SlotEvent(slot=0, state="decode"),
              TierEvent(action="shrink", mib=64.0), GraphEvent(action="capture", kind="decode", key="b8 L1024")]
    for seq, e in enumerate(events, start=1):
        e.seq = seq
    # seqs before each step and after the last: step 1 published events 2..3, step 2 event 4
    longest = _longest_step([0.21, 1.51, 0.01], timings, [0, 1, 3, 4], events)
    assert longest["step"] == 1 and longest["ms"] == pytest.approx(1510.0)
    assert longest["decode_ms"] == pytest.approx(1500.0) and longest["chunk_tokens"] == 0
    assert longest["events"] == ["tier shrink"]  # the slot event is not named; the capture was another step's
    assert _longest_step([], [], [0], []) == {}


def test_graphs_reports_each_kind_from_the_cache_snapshot(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["graphs", *TINY, "--batches", "1,2", "--prompt-tokens", "16", "--new-tokens", "6"])
    kinds = {r["kind"]: r for r in doc["rows"]}
    assert "decode" in kinds
    assert set(kinds) <= {"decode", "verify", "prefill", "draft_prefill", "draft_round", "draft_step", "verify_draft"}
    snapshot_graphs = doc["snapshot"]["graphs"]
    assert doc["summary"]["graphs"] == len(snapshot_graphs) == sum(r["graphs"] for r in doc["rows"])
    assert kinds["decode"]["graphs"] >= 2  # batch buckets 1 and 2 are different graphs
    assert all(r["capture_ms"] > 0 and r["replays"] >= 0 for r in doc["rows"])
    assert doc["summary"]["degraded"] == 0


def test_graphs_with_mtp_drafting_reports_the_drafter_kinds(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["graphs", "--model", "random:tiny+mtp", "--device", "cpu", "--batch-mtp", "--mtp-depth",
                           "2", "--batches", "1", "--prompt-tokens", "16", "--new-tokens", "6"])
    kinds = {r["kind"] for r in doc["rows"]}
    assert {"verify", "draft_round", "draft_step"} <= kinds  # depth 2: a round, then one chained step
    assert doc["summary"]["mtp_active"] is True


def test_switches_runs_each_chosen_switch_off_then_on(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["switches", *TINY, "--only", "FUSED_PROJ,split_attn", "--batches", "1",
                           "--prompt-tokens", "16", "--long-prompt-tokens", "40", "--new-tokens", "4"])
    assert [(r["switch"], r["state"]) for r in doc["rows"]] == [
        ("FUSED_PROJ", "off"), ("FUSED_PROJ", "on"), ("SPLIT_ATTN", "off"), ("SPLIT_ATTN", "on")]
    assert [r["prompt_tokens"] for r in doc["rows"]] == [16, 16, 40, 40]
    assert all(r["decode_tok_s"] > 0 and r["cold_s"] > 0 and r["degraded"] is False for r in doc["rows"])
    assert {"FUSED_PROJ_decode_speedup_b1", "SPLIT_ATTN_decode_speedup_b1"} <= set(doc["summary"])


def test_mtp_on_and_off_with_acceptance_per_position(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["mtp", "--model", "random:tiny+mtp", "--device", "cpu", "--batches", "1",
                           "--prompt-tokens", "12", "--new-tokens", "10", "--mtp-depth", "2", "--repeats", "3",
                           "--warmup-s", "0"])
    off, on = doc["rows"]
    assert (off["mtp"], on["mtp"]) == ("off", "on")
    for row in (off, on):  # the median of three timed runs, with their spread, each run the same tokens
        assert row["decode_tok_s_min"] <= row["decode_tok_s"] <= row["decode_tok_s_max"]
        assert row["same_tokens_each_run"] is True
    assert off["acceptance"] == [] and off["tokens_per_step"] == 1.0
    assert on["mtp_active"] is True and len(on["acceptance"]) == 2
    assert all(a is None or 0.0 <= a <= 1.0 for a in on["acceptance"])
    assert 1.0 <= on["tokens_per_step"] <= 3.0  # at most the sampled token plus both drafts
    assert doc["summary"]["speedup_b1"] > 0 and "same_tokens_b1" in doc["summary"]
    # each mode's engine built twice (off, on, on, off): the speed-up of each half of the run (2 + 1 timed runs)
    halves = doc["summary"]["speedup_b1_halves"]
    assert len(halves) == 2 and all(h > 0 for h in halves)
    # each visit's record: its timed runs' rates (the row's median comes from them), after at least the run
    # that captured its graphs; no SM clock off CUDA
    for row in (off, on):
        visits = row["visits"]
        assert [v["visit"] for v in visits] == ([0, 3] if row["mtp"] == "off" else [1, 2])
        assert [len(v["decode_tok_s"]) for v in visits] == [2, 1]
        assert statistics.median(sum((v["decode_tok_s"] for v in visits), [])) == pytest.approx(row["decode_tok_s"],
                                                                                                 rel=1e-3)
        assert all(v["warmup_runs"] >= 1 and v["sm_clock_mhz"] == [None] * len(v["decode_tok_s"]) for v in visits)
        for v in visits:  # how fast the host ran after each run, and where
            assert len(v["host_probe"]) == len(v["decode_tok_s"])
            cpus = os.sched_getaffinity(0)
            assert all(p["us"] > 0 and (p["cpu"] is None or p["cpu"] in cpus) for p in v["host_probe"])


def test_bad_options_name_what_was_wrong(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    out = str(tmp_path / "x.json")
    with pytest.raises(ConfigError, match="model='random:huge'.*unknown random size"):
        cli_bench.run(parser.parse_args(["decode", "--model", "random:huge", "--device", "cpu", "--json", out]))
    with pytest.raises(ConfigError, match="graph_modes='sometimes'"):
        cli_bench.run(parser.parse_args(["decode", *TINY, "--graph-modes", "sometimes", "--json", out]))
    with pytest.raises(ConfigError, match="new_tokens=0"):
        cli_bench.run(parser.parse_args(["decode", *TINY, "--new-tokens", "0", "--json", out]))
    with pytest.raises(UnknownSwitch, match="'NOPE'"):
        cli_bench.run(parser.parse_args(["switches", *TINY, "--only", "NOPE", "--json", out]))
    with pytest.raises(ConfigError, match="warmup_s=-1.0"):
        cli_bench.run(parser.parse_args(["mtp", *TINY, "--warmup-s", "-1", "--json", out]))
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", "--batches", "1,0"])
    assert not Path(out).exists()


def test_module_entry_point_lists_every_benchmark_without_torch() -> None:
    code = ("import sys, runpy\nsys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('engine.bench', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    for name in cli_bench.BENCHES:
        assert name in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_an_engine_that_dies_mid_benchmark_is_one_clear_error(tmp_path: Path) -> None:
    from engine.bench.engine_driver import EngineDied

    # A sticky CUDA error at the first decode graph's instantiate (the graph cache's fault injection, CPU
    # backend) kills the engine: the benchmark must stop with the engine's own reason, not hang or crash.
    from tests.fault_injection import installed

    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    args = parser.parse_args(["graphs", *TINY, "--batches", "1", "--prompt-tokens", "8", "--new-tokens", "4",
                              "--json", str(tmp_path / "g.json")])
    with installed("instantiate:decode:1:sticky"), \
            pytest.raises(EngineDied, match="died during the benchmark: .*illegal memory access"):
        cli_bench.run(args)


def test_report_table_and_json_writing(tmp_path: Path) -> None:
    from engine.bench.report import format_table, write_json

    table = format_table([{"a": 1, "b": 1234.5678}, {"a": None, "c": 0.000123}])
    header, rule, first, second = table.splitlines()
    assert header.split() == ["a", "b", "c"] and set(rule) <= {"-", " "}
    assert first.split() == ["1", "1,235", "-"] and second.split() == ["-", "-", "1.23e-04"]
    path = write_json(tmp_path / "deep" / "r.json", {"x": float("nan"), "t": (1, 2)})
    assert json.loads(path.read_text()) == {"x": None, "t": [1, 2]}
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


@pytest.mark.parametrize("mtp", [False, True])
def test_profile_names_host_functions_and_ops_of_a_steady_step(tmp_path: Path, mtp: bool) -> None:
    extra = ["--model", "random:tiny+mtp", "--batch-mtp", "--mtp-depth", "2"] if mtp else []
    doc = bench(tmp_path, ["profile", *TINY, *extra, "--prompt-tokens", "40", "--steps", "6", "--top", "5",
                           "--batch", "2"])
    summary = doc["summary"]
    assert summary["batch"] == 2 and summary["mtp"] is mtp and summary["step_ms_p50"] > 0
    assert summary["top_level_ops_per_step"] > 10 and summary["cpu_op_ms"] > 0  # CPU: torch ops, not kernels
    assert summary["pdl"] is False  # the launch option an A/B toggles (STRATA_PDL), as the engine ran: off on a CPU
    host = [r for r in doc["rows"] if r["section"] == "host"]
    ops = [r for r in doc["rows"] if r["section"] == "cpu_ops"]
    assert len(host) == 5 and len(ops) == 5
    assert host == sorted(host, key=lambda r: r["own_us_per_step"], reverse=True)
    assert any(r["name"].startswith("aten::") for r in ops)
    # the phase pass: every phase named once, each part of a step counted where it ran, the forward the only
    # phase left out of the host's figure
    phases = {r["name"]: r for r in doc["rows"] if r["section"] == "phase"}
    assert list(phases) == ["schedule", "forward", "sample", "execute", "update", "detokenize", "deliver",
                            "telemetry", "to_clients", "other"]
    for name in ("schedule", "execute", "update", "deliver", "to_clients"):
        assert phases[name]["calls_per_step"] == 1 and phases[name]["us_per_step"] > 0, name
    assert phases["detokenize"]["calls_per_step"] == 2  # one append per decoding request a step
    assert phases["forward"]["calls_per_step"] >= 1 and phases["forward"]["us_per_step"] > 0
    assert phases["update"]["us_per_row"] == pytest.approx(phases["update"]["us_per_step"] / 2)
    total_us = sum(r["us_per_step"] for r in phases.values())
    assert total_us == pytest.approx(summary["phase_step_ms"] * 1e3, rel=1e-6)
    assert summary["host_us_per_step"] == pytest.approx(total_us - phases["forward"]["us_per_step"], rel=1e-6)


def test_profile_splits_the_device_idle_time_into_launch_gaps_and_host_waits() -> None:
    from engine.bench.profile import gap_split_us

    # Two replays of three kernels (gaps of 2 and 3 us inside each), 100 us of host between them, and a kernel
    # of another stream covering the first replay's 2 us gap: the device was not idle then.
    spans = [(0, 10), (12, 20), (5, 15), (23, 30), (130, 140), (142, 150), (153, 160)]
    short, long = gap_split_us(spans, 20.0)
    assert (short, long) == (3.0 + 2.0 + 3.0, 100.0)
    assert gap_split_us([], 20.0) == (0.0, 0.0)


def test_attention_bench_times_the_reference_per_case_and_checks_its_output(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["attention", "--device", "cpu", "--contexts", "300", "--batches", "1,2", "--q-lens", "1,3",
                           "--iters", "2", "--rows", "decode"])
    rows = doc["rows"]
    assert [(r["case"], r["batch"], r["q_len"], r["kv"]) for r in rows] == [
        ("decode", b, t, kv) for b in (1, 2) for t in (1, 3) for kv in ("bf16", "int8")]
    assert all(r["torch_ms"] > 0 and r["torch_max_err"] == 0 and "triton_ms" not in r for r in rows)  # no kernel on CPU
    assert doc["summary"]["cases"] == 4 * 2 and doc["summary"]["min_triton_speedup"] is None


def test_attention_bench_prefill_rows_time_a_chunk_over_each_prefix_depth(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["attention", "--device", "cpu", "--rows", "prefill", "--prefill-prefixes", "100,300",
                           "--prefill-chunk", "48", "--iters", "2", "--prefill-tune", "32x16x4x2"])
    rows = doc["rows"]
    assert [(r["case"], r["prefix"], r["chunk"], r["context"], r["kv"]) for r in rows] == [
        ("prefill", p, 48, p + 48, kv) for p in (100, 300) for kv in ("bf16", "int8")]
    for row in rows:  # CPU: the reference as the runner runs a chunk there; no kernel, so no tuned shapes either
        assert row["torch_path"] == "gather+sdpa" and row["torch_max_err"] == 0
        flops = 4 * 48 * (row["prefix"] + 24) * 16 * 128  # the causal chunk's dots at the 0.6B shape
        assert row["torch_ms"] > 0 and math.isclose(row["torch_tflops"], flops / row["torch_ms"] / 1e9, abs_tol=2e-3)
        assert not any(k.startswith(("triton", "q32_")) for k in row)
    assert doc["summary"]["cases"] == 4


@pytest.mark.parametrize("argv,match", [
    (["--rows", "verify"], "rows='verify'"), (["--prefill-tune", "128x64x8"], "prefill_tune='128x64x8'"),
    (["--tune", "128xfourx2"], "tune='128xfourx2'"),
    (["--prefill-tune", "128x64x4x3xfast"], "'128x64x4x3xfast': loads 'fast': expected one of gather, block, tma")])
def test_attention_bench_names_a_bad_selection_or_launch_shape(tmp_path: Path, argv, match) -> None:
    with pytest.raises(ConfigError, match=match):
        bench(tmp_path, ["attention", "--device", "cpu", "--contexts", "300", "--batches", "1", *argv])


def test_kvspill_runs_both_configurations_and_reports_the_traffic(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["kvspill", *TINY, "--prompt-tokens", "300", "--new-tokens", "6", "--kv-resident", "64",
                           "--prefill-chunk-tokens", "64", "--step-token-budget", "128"])
    room, spill = doc["rows"]
    assert (room["run"], room["kv_resident"], spill["run"], spill["kv_resident"]) == ("room", None, "spill", 64)
    assert room["context"] == spill["context"] >= 300 + 6
    assert spill["fetched_mib"] > 0 and spill["spilled_mib"] > 0 and spill["h2d_gib_s"] > 0
    assert doc["summary"]["same_tokens"] is True and spill["floor_tok_s"] > 0
    assert doc["summary"]["same_tokens_as_alone"] is True


def test_kvspill_with_the_seeds_six_long_prompts_spills_every_step_and_keeps_the_tokens(tmp_path: Path) -> None:
    """Issue 18's scenario in bench form: six slots each decoding a long prompt, a pool sized for two, so their
    non-resident KV spills and is fetched back all along, and the tokens are those of the run with room."""
    doc = bench(tmp_path, ["kvspill", *TINY, "--slots", "6", "--prompt-tokens", "200", "--new-tokens", "4",
                           "--kv-resident", "64", "--prefill-chunk-tokens", "64", "--step-token-budget", "128"])
    room, spill = doc["rows"]
    assert room["tokens"] == spill["tokens"] == 6 * 4
    assert spill["fetched_mib"] > 0 and spill["spilled_mib"] > 0 and doc["summary"]["same_tokens"] is True
    assert doc["summary"]["same_tokens_as_alone"] is True
    with pytest.raises(ConfigError, match="slots=1"):
        bench(tmp_path, ["kvspill", *TINY, "--slots", "1", "--prompt-tokens", "200", "--new-tokens", "4"])


def test_each_tuned_launch_shape_reports_its_error_beside_its_time() -> None:
    """`--prefill-tune` picks launch shapes by speed: a faster shape must also be right, so each one's max error
    against the reference is in its row (rows that time every shape but check only the default would let a
    fast wrong shape win)."""
    import torch

    from engine.bench.attention_common import time_launch_shapes

    expected = torch.arange(8.0)
    row: dict = {}
    time_launch_shapes(row, [("right", lambda: lambda: expected.clone()), ("off", lambda: lambda: expected + 0.5),
                             ("broken", lambda: (_ for _ in ()).throw(RuntimeError("too much shared memory")))],
                       2, expected)
    assert row["right_max_err"] == 0 and row["off_max_err"] == 0.5 and row["right_ms"] >= 0 and row["off_ms"] >= 0
    assert row["broken_error"].startswith("RuntimeError: too much shared memory") and "broken_ms" not in row


def test_admission_sums_the_steps_that_published_graph_or_tier_events() -> None:
    """`during_event_step_s`: the steps whose seq range holds a graph or tier event (a capture mid-admission), not
    those with other events only."""
    from types import SimpleNamespace

    from engine.bench.admission import _event_steps_s

    events = [SimpleNamespace(seq=2, type="graph"), SimpleNamespace(seq=3, type="request"),
              SimpleNamespace(seq=5, type="tier"), SimpleNamespace(seq=6, type="tier")]
    # step i published the events with seqs[i] < seq <= seqs[i + 1]
    assert _event_steps_s([0.1, 0.2, 0.4, 0.8], [0, 1, 3, 4, 6], events) == pytest.approx(0.2 + 0.8)


def test_decode_compares_weight_formats_one_engine_each(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["decode", *TINY, "--batches", "1", "--prompt-tokens", "8", "--new-tokens", "5",
                           "--graph-modes", "off", "--weight-formats", "off,fp8,fp8+head,int4"])
    rows = doc["rows"]
    assert [r["weights"].split()[0] for r in rows] == ["fp32", "fp8", "fp8", "int4"]
    assert rows[0]["weights_mib"] > rows[1]["weights_mib"] > rows[3]["weights_mib"]  # the embedding stays fp32
    assert "head" in rows[2]["weights"] and "head" not in rows[1]["weights"]  # --quantize-head: the engine's label
    assert all(r["tokens"] == 5 and r["decode_tok_s"] > 0 for r in rows)
    assert {"fp8_vs_fp32_b1", "fp8+head_vs_fp32_b1", "int4_vs_fp32_b1"} <= set(doc["summary"])
    with pytest.raises(ConfigError, match="weight_formats='int3'"):
        bench(tmp_path, ["decode", *TINY, "--weight-formats", "int3"])
    # int4 with --int4-decode tinygemm, a row of its own beside int4 (on the GPU; the CPU refuses the option)
    from engine.bench.decode import format_overrides, weight_formats

    assert weight_formats("off,int4,int4+tinygemm") == ["off", "int4", "int4+tinygemm"]
    assert format_overrides("int4+tinygemm") == {"quantize": "int4", "int4_decode": "tinygemm"}
    assert format_overrides("int4+head+tinygemm") == {"quantize": "int4", "quantize_head": True,
                                                      "int4_decode": "tinygemm"}
    for bad in ("fp8+tail", "fp8+head+head", "fp9+head"):
        with pytest.raises(ConfigError, match="weight_formats"):
            weight_formats(f"off,{bad}")
    with pytest.raises(ConfigError, match="int4_decode='tinygemm'"):
        bench(tmp_path, ["decode", *TINY, "--batches", "1", "--prompt-tokens", "8", "--new-tokens", "5",
                         "--graph-modes", "off", "--weight-formats", "int4+tinygemm"])
