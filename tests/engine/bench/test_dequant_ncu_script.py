"""benchmarks/dequant_ncu.py, the program run_all_gpu.sh's dequant_ncu step hands to Nsight Compute, runs: a broken
import or argument there would cost a GPU call before anyone saw it. On the CPU its Triton kernel runs interpreted."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = str(ROOT / "benchmarks/dequant_ncu.py")
SMALL = ["--device", "cpu", "--out-features", "32", "--in-features", "256"]


def _run(*extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, SCRIPT, *SMALL, *extra], env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_ncu_program_runs_the_dequantizing_kernel_beside_a_copy():
    done = _run("--rounds", "1")
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_ncu_program_names_a_format_it_does_not_know():
    done = _run("--format", "int3")
    assert done.returncode != 0 and "int3" in done.stderr
