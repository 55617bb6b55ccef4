"""`bench throughput` at tiny sizes on CPU: every set and concurrency is a row with its latencies, the floor counts
the live KV as well as the weights, and the HF peer runs bounded in time (a peer past its limit is a row with
its error, not a hang). No timing assertions."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from engine.bench.throughput import floor_tok_s, percentile, request_set
from tests.engine.bench.test_bench import TINY, _checkpoint_cache_and_one_thread, bench  # noqa: F401 (fixture)

SMALL = ["--prompt-tokens", "16", "--new-tokens", "4", "--mixed-prompt-tokens", "8,40", "--mixed-new-tokens", "2,6",
         "--copy-mib", "8"]


def test_throughput_rows_for_every_set_and_concurrency_with_the_peer(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "1,3", *SMALL, "--peer", "eager"])
    by = {(r["set"], r["engine"], r["concurrency"]): r for r in doc["rows"]}
    assert set(by) == {("fixed", "strata", 1), ("fixed", "strata", 3), ("mixed", "strata", 1), ("mixed", "strata", 3),
                       ("fixed", "hf_eager", 1), ("fixed", "hf_eager", 3)}
    for (set_name, engine, n), row in by.items():
        assert row["error"] is None, row
        assert row["tok_s"] > 0
        if engine == "strata":
            assert row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["all_first_token_s"]
            assert row["itl_p50_s"] <= row["itl_p99_s"] and row["floor_tok_s"] > 0
            assert row["preemptions"] == 0 and row["steps"] >= 4
            assert row["step_token_budget"] >= 4096  # no --step-token-budget: the device's rule
    assert by[("fixed", "strata", 3)]["output_tokens"] == 3 * 4
    mixed = by[("mixed", "strata", 3)]["output_tokens"]
    assert 3 * 2 <= mixed <= 3 * 6
    assert doc["summary"]["peer_best"]["engine"] == "hf_eager"
    assert doc["summary"]["decode_rises_with_concurrency"] in (True, False)


def test_the_peer_runs_only_up_to_its_largest_concurrency(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "1,2,3", "--sets", "fixed", *SMALL, "--peer", "eager",
                           "--peer-max-concurrency", "2"])
    assert sorted(r["concurrency"] for r in doc["rows"] if r["engine"] == "hf_eager") == [1, 2]
    assert sorted(r["concurrency"] for r in doc["rows"] if r["engine"] == "strata") == [1, 2, 3]


def test_chunk_rows_off_runs_every_chunk_as_its_own_forward(tmp_path: Path, monkeypatch) -> None:
    from engine.exec import chunk_rows

    shared: list[int] = []
    real = chunk_rows.prefill_rows

    def counted(runner, rows):
        shared.append(len(rows))
        return real(runner, rows)

    monkeypatch.setattr(chunk_rows, "prefill_rows", counted)
    argv = ["throughput", *TINY, "--concurrency", "4", "--sets", "fixed", *SMALL, "--peer", "none"]
    on = bench(tmp_path, argv)
    assert shared and max(shared) >= 2 and on["rows"][0]["chunk_rows"] == "on"
    shared.clear()
    off = bench(tmp_path, [*argv, "--chunk-rows", "off"])
    assert shared == [] and off["rows"][0]["chunk_rows"] == "off"
    assert off["rows"][0]["output_tokens"] == on["rows"][0]["output_tokens"] == 4 * 4


def test_a_peer_past_its_time_limit_is_a_row_with_the_reason(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "1", "--sets", "fixed", *SMALL, "--peer", "static",
                           "--peer-timeout-s", "0.01"])
    peer = next(r for r in doc["rows"] if r["engine"].startswith("hf_"))
    assert peer["tok_s"] is None and "did not finish within --peer-timeout-s" in peer["error"]
    assert "stopped in " in peer["error"] or "stopped before Python started" in peer["error"], peer


def test_the_peer_takes_prompts_past_the_argv_limit_and_says_where_its_time_went(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """64 prompts of 1K tokens as one argv string are past Linux's 128 KiB per-argument limit (E2BIG): the
    peer reads them from a file, removed after, and its row gives each phase's seconds."""
    import argparse
    import json
    import tempfile

    from engine.bench.common import device_of, prepare_model, random_prompt
    from engine.bench.throughput import peer_row

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path = prepare_model("random:tiny", device_of("cpu"))
    prompts = [random_prompt(4600, 512, seed=i) for i in range(8)]
    assert len(json.dumps(prompts)) > 131072  # one argv string this long fails with OSError E2BIG
    args = argparse.Namespace(peer="eager", peer_dtype="float32", peer_timeout_s=300.0)
    row = peer_row(args, path, device_of("cpu"), prompts, 2)
    assert row["error"] is None and row["tok_s"] > 0, row
    phases = row["peer_phases_s"]
    assert list(phases)[:2] == ["importing torch and transformers", "loading the checkpoint"], phases
    assert "warm-up call 1 of 1" in phases and "1 timed call" in phases
    assert all(seconds >= 0 for seconds in phases.values())
    assert list(scratch.iterdir()) == []  # the request and progress files are gone


def test_the_floor_reads_the_live_kv_as_well_as_the_weights() -> None:
    weights_only = floor_tok_s(1_000_000, 0, 4, 1000.0, 1.0)
    assert math.isclose(weights_only, 4 * 1e9 / 1_000_000)
    with_kv = floor_tok_s(1_000_000, 100, 4, 1000.0, 1.0)  # 4 rows x 1000 tokens x 100 bytes: 400 KB more a step
    assert math.isclose(with_kv, 4 * 1e9 / 1_400_000)


def test_the_mixed_set_is_seeded_and_within_its_ranges() -> None:
    import argparse

    args = argparse.Namespace(seed=3, prompt_tokens=8, new_tokens=2, mixed_prompt_tokens=[128, 8192],
                              mixed_new_tokens=[64, 1024])
    one, again = request_set("mixed", 16, 1000, args), request_set("mixed", 16, 1000, args)
    assert one == again
    assert all(128 <= len(p) <= 8192 and 64 <= n <= 1024 for p, n in one)
    assert len({len(p) for p, _ in one}) > 8
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None


def test_a_bad_range_names_the_option(tmp_path: Path) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        bench(tmp_path, ["throughput", *TINY, "--concurrency", "1", "--mixed-new-tokens", "9,3"])
    assert err.value.param == "mixed_new_tokens"


def test_a_device_fault_that_surfaces_at_close_keeps_the_rows_so_far(tmp_path: Path, monkeypatch) -> None:
    """A sticky CUDA fault raised by the engine's close (where an asynchronous illegal access surfaces) ends the run
    with exit 1, but the row it ended keeps its figures and the error, and the JSON and table are written."""
    import argparse
    import json

    from engine.bench import command as cli_bench
    from engine.bench.engine_driver import BenchEngine

    real_close = BenchEngine.close
    closes = []

    def close(self) -> None:
        real_close(self)
        closes.append(1)
        if len(closes) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(BenchEngine, "close", close)
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    out = tmp_path / "throughput.json"
    args = parser.parse_args(["throughput", *TINY, "--concurrency", "1,2,3", "--sets", "fixed", *SMALL,
                              "--peer", "none", "--json", str(out)])
    assert cli_bench.run(args) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]  # the row at 3 never ran on a faulted device
    assert rows[0]["error"] is None and rows[1]["tok_s"] > 0
    assert rows[1]["error"] == "at close: RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("warm_up", ["burst", "short"])
def test_each_row_warms_up_on_a_burst_of_its_own_shape_unless_asked_for_a_fresh_engine(tmp_path: Path, monkeypatch,
                                                                                          warm_up: str) -> None:
    """A fresh engine's first burst compiles kernels and captures a graph per batch bucket and chunk size inside
    the timed run (on an H100, rows of one call swung 2x with which row paid them first); by default a row first
    serves the same number of prompts, other tokens, until they have decoded together for a few steps. The row says
    which, and what one-time work (graph captures, KV pool growths) still fell inside its clock."""
    from engine.bench import throughput

    served: list[list[tuple[int, int]]] = []
    real = throughput.drive

    def recorded(engine, requests, trace=None, **kw):
        served.append([(len(prompt), new) for prompt, new in requests])
        return real(engine, requests, trace, **kw)

    monkeypatch.setattr(throughput, "drive", recorded)
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "3", "--sets", "fixed", *SMALL, "--new-tokens", "6",
                           "--peer", "none", "--warm-up", warm_up])
    row = doc["rows"][0]
    assert row["error"] is None and row["warm_up"] == warm_up
    assert served[1] == [(16, 6)] * 3  # the timed burst
    assert served[0] == ([(16, 6)] * 3 if warm_up == "burst" else [(16, 6)] * 2), served[0]
    assert row["graph_captures"] >= 0 and row["pool_growths"] >= 0


def test_the_warm_up_burst_decodes_the_whole_batch_at_once(tmp_path: Path, monkeypatch) -> None:
    """With 4 output tokens each, the first prompts of a burst whose admission takes several steps finished
    before the last ones were admitted: the warm-up never decoded the whole batch, and the timed burst compiled
    and captured its decode step (on an H100 a 2.2 s step at 128 concurrent, by use and reserved alike). Here
    admission takes 8 steps or more (4 prompts of 256 tokens, 128 tokens a step, paced by the step costs)."""
    from engine.bench import throughput
    from engine.orchestration.engine import Engine

    decoding: list[list[int]] = []
    real_step, real_drive = Engine.step, throughput.drive

    def step(self):
        out = real_step(self)
        decoding[-1].append(self.sched.num_decoding)
        return out

    def drive(engine, requests, trace=None, **kw):
        decoding.append([])
        return real_drive(engine, requests, trace, **kw)

    monkeypatch.setattr(Engine, "step", step)
    monkeypatch.setattr(throughput, "drive", drive)
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "4", "--sets", "fixed", "--prompt-tokens", "256",
                           "--new-tokens", "192", "--prefill-chunk-tokens", "64", "--step-token-budget", "128",
                           "--peer", "none"])
    assert doc["rows"][0]["error"] is None
    warm_up, timed = decoding
    assert max(timed) == 4 and max(warm_up) == 4, (warm_up, timed)


def test_slow_steps_name_the_slowest_steps_and_what_the_engine_published_in_each(tmp_path: Path, monkeypatch) -> None:
    # A stall injected into one step of the timed burst (a step that sleeps and warns, as a capture or a tier
    # growth would publish its event): the row's slowest step is that one, with its event in the details.
    from engine.orchestration.engine import Engine
    from engine.telemetry import WarningEvent

    real = Engine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 3 + warm_steps["n"]:
            time.sleep(0.5)
            self.bus.publish(WarningEvent(where="test", message="injected stall"))
        return real(self)

    warm_steps = {"n": 10**9}  # no stall during the warm-up burst: set once the timed burst starts
    from engine.bench import throughput

    real_drive = throughput.drive

    def drive(engine, requests, trace=None, **kw):
        if trace is not None:
            warm_steps["n"] = calls["n"]
        return real_drive(engine, requests, trace, **kw)

    monkeypatch.setattr(Engine, "step", step)
    monkeypatch.setattr(throughput, "drive", drive)
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "4", "--sets", "fixed", *SMALL, "--peer", "none",
                           "--slow-steps", "2"])
    row = doc["rows"][0]
    slow = row["slow_steps"]
    assert len(slow) == 2 and slow[0]["step"] < slow[1]["step"]  # the two longest, in the order they ran
    stalled = max(slow, key=lambda s: s["seconds"])
    assert stalled["step"] == 2 and stalled["seconds"] >= 0.5
    assert stalled["events"].get("warning") == 1 and "warning message=injected stall" in stalled["details"]
    assert all(s["outputs"] >= 0 and s["at_s"] >= 0 and "functions" not in s for s in slow)
    # under cProfile the stall names where its time went (here: the sleep)
    calls["n"], warm_steps["n"] = 0, 10**9
    profiled = bench(tmp_path, ["throughput", *TINY, "--concurrency", "4", "--sets", "fixed", *SMALL, "--peer", "none",
                                "--slow-steps", "1", "--slow-steps-profile"])
    (step,) = profiled["rows"][0]["slow_steps"]
    top = step["functions"][0]
    assert step["step"] == 2 and "sleep" in top["function"] and top["seconds"] >= 0.5, step["functions"][:3]
    without = bench(tmp_path, ["throughput", *TINY, "--concurrency", "4", "--sets", "fixed", *SMALL, "--peer", "none"])
    assert "slow_steps" not in without["rows"][0]


def test_a_slow_step_names_the_triton_kernels_compiled_during_it() -> None:
    """A first-seen shape in a timed burst is a compile of seconds that publishes no event. The step trace sets
    Triton's post-compile hook (chained to one already set, given back at `finish`) and lists each compile under
    the step it fell in, as Triton describes it: the kernel and the argument types it was specialized for."""
    from triton import knobs

    from engine.bench.step_trace import StepTrace

    seen, original = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    try:
        trace = StepTrace(lambda: [], keep=2)
        trace.before_step()
        trace.after_step(0.0, 0.001, 1)
        trace.before_step()
        knobs.runtime.jit_post_compile_hook(key=None, repr="_paged_decode[num_warps=4](q: *bf16, n: i32)", fn=None,
                                            compile={}, is_manual_warmup=False, already_compiled=False)
        trace.after_step(0.001, 2.2, 1)
        trace.finish()
        quick, slow = trace.slowest()
        assert quick["compiled"] == [] and slow["compiled"] == ["_paged_decode[num_warps=4](q: *bf16, n: i32)"]
        assert "    triton compiled _paged_decode[num_warps=4](q: *bf16, n: i32)" in StepTrace.lines(128, [slow])
        assert seen == ["_paged_decode[num_warps=4](q: *bf16, n: i32)"]  # the hook that was set still ran
        knobs.runtime.jit_post_compile_hook(repr="after finish")
        assert seen[-1] == "after finish" and len(seen) == 2  # given back
    finally:
        knobs.runtime.jit_post_compile_hook = original


def test_a_rows_steps_run_with_the_engines_startup_heap_out_of_the_collectors_reach(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """A full collection walks every tracked object: a loaded engine's heap (torch, Triton, the model) is a few
    hundred thousand, over a hundred milliseconds on this box, and under load the collector ran one inside a step
    every few seconds (every slot stalled for it: a 256-slot burst's slowest steps). `strata-engine serve`
    freezes the heap once its engine is ready; a bench's engines do too, and thaw it when they close, so the
    cycles of a row's dropped engine can still be collected."""
    import gc

    from engine.orchestration.engine import Engine

    frozen: list[int] = []
    real_step = Engine.step

    def step(self):
        frozen.append(gc.get_freeze_count())
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "2", "--sets", "fixed", *SMALL, "--new-tokens", "4",
                           "--peer", "none"])
    assert doc["rows"][0]["error"] is None
    assert frozen and min(frozen) > 10_000, frozen[:3]  # torch's modules and the model: the startup heap
    assert gc.get_freeze_count() == 0  # thawed when the row's engine closed


def test_a_rows_preemptions_are_its_timed_bursts_not_its_warm_ups(tmp_path: Path, monkeypatch) -> None:
    """A warm-up burst that preempted (a burst past the pool does) leaves its count in the engine's paging stats:
    the row reports only what the timed burst preempted (here none), not the two bursts together."""
    from engine.bench import throughput

    real, calls = throughput.drive, []

    def warm_up_that_preempts(engine, requests, trace=None, settle_steps=None):
        calls.append(settle_steps)
        result = real(engine, requests, trace, settle_steps)
        if settle_steps is not None:  # the warm-up (the timed burst runs to its end)
            engine.kv.paging.stats.preemptions += 7
        return result

    monkeypatch.setattr(throughput, "drive", warm_up_that_preempts)
    doc = bench(tmp_path, ["throughput", *TINY, "--concurrency", "3", "--sets", "fixed", *SMALL, "--peer", "none",
                           "--kv-pool", "by-use"])
    assert calls[0] is not None and calls[-1] is None  # a warm-up burst, then the timed one
    assert doc["rows"][0]["error"] is None and doc["rows"][0]["preemptions"] == 0
