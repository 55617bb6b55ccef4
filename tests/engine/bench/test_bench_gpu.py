"""The CUDA-only paths of the benchmarks (graphs on, the compiled HF peer, device copy bandwidth), at tiny
sizes. Skipped without a GPU; the lead runs them on the H200. The CPU tests cover the same logic otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.bench.test_bench import _checkpoint_cache_and_one_thread, bench  # noqa: F401 (fixture)

CUDA_TINY = ["--model", "random:tiny", "--device", "cuda:0"]


@pytest.mark.gpu
def test_decode_with_cuda_graphs_on_and_off(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["decode", *CUDA_TINY, "--batches", "1,2", "--prompt-tokens", "16", "--new-tokens", "8"],
                device="cuda:0")
    modes = {(r["graphs"], r["batch"]): r for r in doc["rows"]}
    assert set(modes) == {("on", 1), ("on", 2), ("off", 1), ("off", 2)}
    assert all(r["graphs_active"] == (r["graphs"] == "on") for r in doc["rows"])
    assert all(r["tokens"] == 8 * r["batch"] for r in doc["rows"])
    assert doc["env"]["device_name"]


@pytest.mark.gpu
def test_graphs_bench_measures_cuda_graph_memory(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["graphs", *CUDA_TINY, "--batches", "1,2", "--prompt-tokens", "16", "--new-tokens", "6"],
                device="cuda:0")
    assert doc["env"]["executor_wiring"] == "engine"  # engine_setup wires the GraphCache itself on CUDA
    assert doc["summary"]["graphs"] >= 2 and doc["summary"]["total_mib"] >= 0


@pytest.mark.gpu
@pytest.mark.soak  # torch.compile of the peer: with the seed-scenario test it took the suite past 450 s
def test_peers_with_the_compiled_static_cache_on_cuda(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["peers", *CUDA_TINY, "--batches", "1", "--prompt-tokens", "8", "--new-tokens", "6",
                           "--copy-mib", "64"], device="cuda:0")
    engines = {r["engine"]: r for r in doc["rows"]}
    assert set(engines) == {"floor", "strata", "hf_eager", "hf_static_compile"}
    assert engines["strata"]["tok_s"] > 0 and engines["hf_eager"]["tok_s"] > 0
    # the compiled peer may fail in a given transformers; then its error is recorded instead of a rate
    compiled = engines["hf_static_compile"]
    assert (compiled["tok_s"] or 0) > 0 or compiled["error"]
    assert doc["summary"]["copy_bandwidth_gb_s"] > 10


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_experts_host_and_peer_stores_in_one_run(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["experts", "--model", "random:moe-small", "--device", "cuda:0", "--peer-device", "cuda:1",
                           "--stores", "host,peer", "--budgets", "10", "--prompt-tokens", "16", "--new-tokens", "8",
                           "--no-hf"], device="cuda:0")
    rows = [(r["store"], r["budget_pct"]) for r in doc["rows"]]
    assert rows == [("host", 100), ("host", 10), ("cuda:1", 10)]
    assert all(r["same_tokens"] for r in doc["rows"]) and doc["rows"][2]["loaded_mib"] > 0


@pytest.mark.gpu
def test_a_mixed_burst_with_chunks_beside_the_steps_ends_every_request_with_its_tokens(tmp_path: Path) -> None:
    """random:0.6b's mixed set (128-8K-token prompts) at 32 concurrent, on an H100, ended a request with
    NonFiniteLogits in nearly every run, under either KV pool, while a long prompt's chunks beside the steps
    replayed captured graphs on the side stream (engine.exec.runner.ModelRunner.prefill: they run eagerly). One
    pool here (the cause was the same under both; the suite's time is short)."""
    doc = bench(tmp_path, ["throughput", "--model", "random:0.6b", "--device", "cuda:0", "--sets", "mixed",
                           "--concurrency", "32", "--peer", "none", "--copy-mib", "64", "--kv-pool", "by-use",
                           "--prefill-overlap", "on"], device="cuda:0")
    [row] = [r for r in doc["rows"] if r["engine"] == "strata"]
    assert row["error"] is None, row["error"]
    assert row["tok_s"] > 0 and row["output_tokens"] > 0  # every request ran to its max_tokens (else: error)
