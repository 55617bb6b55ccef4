"""Run a check in Triton's interpreter (the real kernels on CPU tensors, fp32), where Triton is installed (not in
CI: its wheel is ~180 MiB). In a fresh process: TRITON_INTERPRET must be set before Triton (or torch, which may
import it) loads."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

INTERPRETER_LIMIT_S = 540


def run_in_interpreter(module: str, check: str, *args: object) -> None:
    """Call `module.check(*args)` (args as Python literals) in a fresh interpreter-mode process; skip without
    Triton, fail with the child's stderr."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = f"from {module} import {check}; {check}({', '.join(repr(a) for a in args)})"
    # The interpreter's dots are numpy's: one BLAS thread, as its programs run one at a time anyway. A seeded check
    # read NaN now and then only on a loaded machine, and a threaded BLAS is the one part of such a run whose work
    # depends on the machine's load.
    env = {**os.environ, "TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    # The limit catches a hung child, not a slow one: beside busy loops on two cores the longest check (the paged
    # prefill kernel's, int8) takes nearly three times its idle time; pytest's own limit (600 s) stays above this.
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=INTERPRETER_LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]


def run_kernels_on_cpu() -> None:
    """Inside an interpreter-mode process: let engines built from now on run the Triton kernels on CPU tensors,
    the paged attention (kv_cache.kernel_backend) and FUSED_OPS (backends.triton_runs). Their device checks are
    the only things bypassed."""
    import engine.exec.kv.cache as kv_cache
    import engine.model.attention.backends as backends

    class InterpretedKernels(backends.TritonPagedAttention):
        def runs_on(self, q):
            return True

    kv_cache.kernel_backend = lambda device: InterpretedKernels()
    backends.triton_runs = lambda device: True
