"""benchmarks/seed_scenario.py end to end on CPU: a real `serve` subprocess, one run, the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_seed_script_one_cpu_run_passes_and_records_both_views_of_memory(tmp_path: Path) -> None:
    out = tmp_path / "seed.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seed_scenario.py"), "--runs", "1",
                           "--device", "cpu", "--random-model", "tiny", "--prompt-tokens", "2000", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["passed"] and run["completed"] == run["requests"] == 7
    books = run["vram_at_ready"]
    assert books[0]["device"] == "cpu" and books[0]["free_mib"] > 0 and books[0]["reserve_mib"] == 1024.0
    # NVML: the driver's view where there is one, else the reason it could not be read (never silently absent).
    for nvml in (run["nvml_at_ready"], run["nvml_after"]):
        assert (isinstance(nvml, list) and nvml[0]["total_mib"] > 0) or nvml.startswith("NVML")
    assert "NVML" in proc.stdout and "1/1 runs passed" in proc.stdout
    assert run["metrics"]["long_ttft_s"] > 0 and "long prompt TTFT" in proc.stdout


def test_seed_script_runs_the_moe_seed_with_a_cache_too_small_for_the_experts(tmp_path: Path) -> None:
    """The seed's own system (issue 20): a Qwen3-MoE whose expert cache cannot hold every expert, so the long
    prompt's admission meets misses and evictions; the report carries the cache's books and its events."""
    out = tmp_path / "seed.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seed_scenario.py"), "--runs", "1",
                           "--device", "cpu", "--random-model", "moe-tiny", "--prompt-tokens", "1500", "--out", str(out),
                           "--extra", "--expert-cache-mib", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["passed"] and run["completed"] == run["requests"] == 7
    ready, after = run["experts_at_ready"], run["experts_after"]
    assert 0 < ready["slots"] < ready["num_experts"] and ready["host_mib"] > 0
    assert after["misses"] > 0 and after["evictions"] > 0 and 0 <= after["hit_rate"] < 1
    # (the published oracle rate may be a replay up to 2 s older than the live counts: both are reported, not compared)
    assert 0 <= after["oracle_hit_rate"] <= 1
    assert run["expert_actions"].get("load", 0) > 0 and run["expert_actions"].get("evict", 0) > 0
    assert "expert cache" in proc.stdout and "evictions" in proc.stdout


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc: the engine runs in a session of its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_terminated_seed_script_takes_its_engine_with_it(tmp_path: Path) -> None:
    """`timeout` ends the script with SIGTERM: its `serve` (a session of its own, so a terminal's Ctrl-C reaches it
    only through the script) must not live on holding the GPU (an orphaned engine keeps the memory its tier filled,
    and the benchmarks after it run out of memory)."""
    import signal
    import time

    script = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "seed_scenario.py"), "--runs", "1",
                               "--device", "cpu", "--random-model", "tiny", "--prompt-tokens", "30000",
                               "--out", str(tmp_path / "seed.json")],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        engines: list[int] = []
        while not engines and time.monotonic() < deadline and script.poll() is None:
            time.sleep(0.2)
            engines = _children(script.pid)
        assert engines, "the script started no engine"
        time.sleep(3.0)  # loading or serving: a 30,000-token run lasts longer than this on CPU
        assert all(_alive(pid) for pid in engines), "the premise: the engine is still running"
        script.send_signal(signal.SIGTERM)
        script.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in engines), f"engine {engines} outlived the script"
        assert script.returncode != 0
    finally:
        script.kill()
        for pid in engines if "engines" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_run_without_its_ttft_says_so(capsys, monkeypatch) -> None:
    """A random checkpoint's tokens can have no text, so the client may see none: a run must not print PASS with
    no TTFT line at all, the missing measurement is said."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports its sibling modules
    spec = importlib.util.spec_from_file_location("seed_scenario", ROOT / "benchmarks" / "seed_scenario.py")
    seed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed)
    seed.print_run({"run": 1, "passed": True, "completed": 7, "requests": 7, "exited_during_run": None,
                    "exit_code_after_sigterm": 0, "graph_actions": {}, "oom_messages": [], "bad_messages": [], "warnings": [], "error_events": [],
                    "metrics": {"long_ttft_s": None, "decode_ratio": None}})
    assert "long prompt TTFT: not measured" in capsys.readouterr().out
