"""benchmarks/run_all_gpu.sh (the one GPU call the lead makes) and benchmarks/collect_results.py, on CPU.

The script is run end to end with tiny sizes, so a broken flag or a benchmark that crashes shows up here and
not in the GPU run. No figure is asserted: only that every benchmark wrote its JSON and the
collector read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import collect_results  # noqa: E402

EXPECTED = ("decode", "peers", "mtp", "mtp_depth2", "admission", "ttft", "graphs", "graphs_mtp", "switches",
            "switches_long", "peers_compile")


def _doc(rows: list[dict], partial: bool = False) -> dict:
    doc = {"bench": "x", "env": {}, "params": {}, "rows": rows, "summary": {}}
    if partial:
        doc["partial"] = True
    return doc


def test_collector_recomputes_targets_from_rows(tmp_path: Path) -> None:
    files = {
        "decode": _doc([{"graphs": "on", "batch": 1, "decode_tok_s": 1800.0},
                        {"graphs": "off", "batch": 1, "decode_tok_s": 300.0}]),
        "peers": _doc([{"engine": "floor", "batch": 1, "tok_s": 4000.0},
                       {"engine": "strata", "batch": 1, "tok_s": 1500.0, "decode_tok_s": 1700.0},
                       {"engine": "hf_eager", "batch": 1, "tok_s": 30.0, "error": None}], partial=True),
        "peers_compile": _doc([{"engine": "hf_static_compile", "batch": 1, "tok_s": None,
                                "error": "RuntimeError: boom"}]),
        "mtp": _doc([{"mtp": "off", "batch": 1, "decode_tok_s": 100.0},
                     {"mtp": "on", "batch": 1, "decode_tok_s": 140.0, "acceptance": [0.6, 0.3]}]),
        "mtp_depth2": _doc([{"mtp": "off", "batch": 1, "decode_tok_s": 100.0},
                            {"mtp": "on", "batch": 1, "decode_tok_s": 145.0, "acceptance": [0.6, 0.3]}]),
        "admission": _doc([{"decode_ratio": 0.7}, {"decode_ratio": 0.45}]),
        "decode_compile": _doc([{"graphs": "on", "batch": 1, "decode_tok_s": 2100.0}]),
        "experts_cold": _doc([{"batch": 6, "budget_pct": 100, "cold": "copy", "vs_all_resident": 1.0,
                               "vs_belady": 1.0},
                              {"batch": 6, "budget_pct": 85, "cold": "copy", "vs_all_resident": 0.7, "vs_belady": 0.93},
                              {"batch": 6, "budget_pct": 85, "cold": "cpu", "vs_all_resident": 0.5, "vs_belady": 0.9}]),
    }
    for name, doc in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    (tmp_path / "broken.json").write_text("{not json")
    assert collect_results.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    met = {t["target"].split(" (")[0]: t["met"] for t in summary["targets"]}
    assert summary["figures"]["decode_b1"] == 1800.0 and met["batch-1 decode tok/s"] is True
    assert summary["figures"]["decode_b1_compile"] == 2100.0 and summary["figures"]["decode_b1_best"] == 2100.0
    assert summary["figures"]["vs_hf_eager_b1"] == 50.0 and met["Strata / HF eager, batch 1"] is False
    assert summary["figures"]["fraction_of_floor"] == 1700.0 / 4000.0
    assert summary["figures"]["mtp_speedup_b1"] == 1.4 and summary["figures"]["mtp_depth2_speedup_b1"] == 1.45
    assert summary["figures"]["mtp_best_speedup_b1"] == 1.45 and met["MTP speedup, batch 1"] is False
    assert summary["figures"]["mtp_acceptance_b1"] == [0.6, 0.3]
    assert summary["figures"]["admission_ratio"] == 0.45
    assert summary["figures"]["experts_cold_copy_vs_all_resident_b6"] == 0.7  # the 85 % rows, not the reference
    assert summary["figures"]["experts_cold_cpu_vs_all_resident_b6"] == 0.5
    assert summary["figures"]["experts_cold_copy_vs_belady_b6"] == 0.93
    assert summary["figures"]["hf_static_compile_b1_error"] == "RuntimeError: boom"
    assert summary["partial"] == ["peers"] and "ttft" in summary["missing"]
    assert summary["unreadable"][0].startswith("broken.json")


@pytest.mark.slow
def test_gpu_script_runs_every_benchmark_on_cpu_at_tiny_sizes(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"), DEVICE="cpu", MODEL="random:tiny",
               MTP_MODEL="random:tiny+mtp", PROMPT="16", NEW="6", LONG="200", TTFT_SIZES="64,128",
               SWITCH_LONG="40", SPLIT_LONG="48", SWITCH_NEW="6", GRAPH_NEW="6", COPY_MIB="4", OMP_NUM_THREADS="1",
               DECODE_COMPILE="0",
               PYTHON=sys.executable, STRATA_BENCH_CACHE=str(tmp_path / "ckpt"), BUDGET_S="800",
               LIMIT_SCALE="4")  # the steps' limits are an H200's; a loaded CPU runs the tiny sizes slower
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all_gpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=840)
    log = (tmp_path / "out" / "run_all_gpu.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    for name in EXPECTED:
        assert f"END {name} rc=0" in log, log[-3000:]
        doc = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert doc["rows"] and "partial" not in doc
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["missing"] == ["decode_compile"] and summary["partial"] == []  # DECODE_COMPILE=0 here
    assert all(t["measured"] is not None for t in summary["targets"])


@pytest.mark.parametrize("scale, limit_s", [(None, 120), ("3", 360)])
def test_limit_scale_multiplies_a_steps_own_limit(tmp_path: Path, scale: str | None, limit_s: int) -> None:
    """`true` stands in for Python: each step "runs" at once, and the log names the limit it ran under."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON="true", STEPS="attention_decode", BUDGET_S="1000")
    env.pop("LIMIT_SCALE", None)
    if scale is not None:
        env["LIMIT_SCALE"] = scale
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all_gpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    log = (tmp_path / "run_all_gpu.log").read_text()
    assert proc.returncode == 0, log
    assert f"START attention_decode (limit {limit_s}s)" in log, log


@pytest.mark.parametrize("steps, writes", [("quant_linear,gpu_suite_alone", False), ("quant_decode", False),
                                           ("quant_linear,decode", True), ("attention_decode", True), ("", True)])
def test_the_checkpoint_is_written_only_for_a_call_whose_steps_read_it(tmp_path: Path, steps: str,
                                                                       writes: bool) -> None:
    """A call of steps that bring their own models (the quantized benches, the GPU suites) does not spend its device
    time writing MODEL's random checkpoint first; a call with any step that reads it (or the default steps) does."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON="true", BUDGET_S="1000")
    env.pop("STEPS", None)
    if steps:
        env["STEPS"] = steps
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all_gpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    log = (tmp_path / "run_all_gpu.log").read_text()
    assert proc.returncode == 0, log
    assert ("START checkpoint" in log) == writes and ("SKIP checkpoint" in log) != writes, log


def test_every_step_named_as_bringing_its_own_model_is_a_step() -> None:
    script = (ROOT / "benchmarks" / "run_all_gpu.sh").read_text()
    steps = set(subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all_gpu.sh"), "--list"], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split())
    own = script.split('OWN_MODEL_STEPS="', 1)[1].split('"', 1)[0].replace("\\\n", " ").split()
    assert len(own) > 10 and set(own) <= steps, set(own) - steps


def _gpu_suite_alone(tmp_path: Path, gpu_tests: str, **env_extra: str) -> str:
    """run_all_gpu.sh's step gpu_suite_alone over GPU_TESTS on CPU (the tests below mark themselves gpu); its log."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, STEPS="gpu_suite_alone",
               GPU_TESTS=gpu_tests, BUDGET_S="1000", DEVICE="cpu", MODEL="random:tiny",
               STRATA_BENCH_CACHE=str(tmp_path / "ckpt"), **env_extra)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all_gpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    log = (tmp_path / "out" / "run_all_gpu.log").read_text()
    assert proc.returncode == 0, log
    return log


def test_a_pytest_step_cut_off_by_its_limit_still_names_every_test_that_ran(tmp_path: Path) -> None:
    """The GPU suite once ran into its call's limit with `-q`: 184 dots, three `F`s and no name. A pytest step
    now prints a line per test as it ends and stops starting tests SESSION_MARGIN_S before its limit, so the run
    below (a test that fails, one that passes, one that sleeps past the session, one more) ends on its own, in
    time, with the failure named and the counts in the log."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_four.py").write_text(
        "import time\nimport pytest\npytestmark = pytest.mark.gpu\n"
        "def test_a_fails():\n    assert 1 == 2\n"
        "def test_b_passes():\n    pass\n"
        "def test_c_sleeps():\n    time.sleep(4)\n"
        "def test_d_never_starts():\n    pass\n")
    log = _gpu_suite_alone(tmp_path, str(suite), SESSION_MARGIN_S="589")  # the step's limit is 590 s
    assert "START gpu_suite_alone (limit 590s, session 1s)" in log, log
    assert "END gpu_suite_alone rc=1" in log, log
    lines = (tmp_path / "out" / "gpu_suite_alone.log").read_text()
    # the session ends after the test that passes its end: after the sleeping one, or sooner on a loaded machine
    # (it counts from pytest's start); the first test always runs
    passed = lines.count(" PASSED")
    assert passed <= 2 and f"gpu_suite_alone: {passed} passed, 1 failed, 0 errors, 0 skipped" in log, log
    assert "FAILED " in log and "test_a_fails" in log, log
    assert "test_d_never_starts" not in lines, lines


def test_gpu_tests_names_several_test_ids_and_the_step_runs_exactly_those(tmp_path: Path) -> None:
    """GPU_TESTS takes several folders, files or test ids, space-separated (the alone half of the GPU suite does
    not fit one call on an H100, so a call runs the part a previous one did not reach)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_three.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\n"
        "def test_a():\n    pass\ndef test_b():\n    pass\ndef test_c():\n    pass\n")
    log = _gpu_suite_alone(tmp_path, f"{suite}/test_three.py::test_a {suite}/test_three.py::test_c")
    assert "gpu_suite_alone: 2 passed, 0 failed, 0 errors, 0 skipped" in log, log
    lines = (tmp_path / "out" / "gpu_suite_alone.log").read_text()
    assert "test_a PASSED" in lines and "test_c PASSED" in lines and "test_b" not in lines, lines
