"""The GPU tests' lock (tests/conftest.py): parallel pytest processes (`-m gpu -n 4 --dist loadgroup`) run the
tests marked `gpu_shared` beside each other, and every other GPU test alone, all of those in one process in their
order. Checked here with real processes, the real lock file and a real xdist run of the hooks, since what matters
is what another process can take while one holds it."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _holder(shared: bool, lock_file: Path) -> subprocess.Popen:
    """A process that holds the lock (through conftest's own function) until its stdin closes."""
    code = (
        "import sys\nfrom pathlib import Path\nfrom tests import conftest\n"
        f"conftest._GPU_LOCK_FILE = Path({str(lock_file)!r})\n"
        f"with conftest._gpu_held(shared={shared}):\n"
        "    print('held', flush=True)\n    sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _can_take(lock_file: Path, mode: int) -> bool:
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "alone"])
def test_a_gpu_test_holding_the_lock_lets_in_only_what_may_run_beside_it(tmp_path: Path, shared: bool) -> None:
    lock_file = tmp_path / "gpu.lock"
    holder = _holder(shared, lock_file)
    try:
        # a shared test admits other shared tests and keeps out one that takes the GPU alone; that one admits none
        assert _can_take(lock_file, fcntl.LOCK_SH) is shared
        assert _can_take(lock_file, fcntl.LOCK_EX) is False
    finally:
        holder.communicate("", timeout=30)
    deadline = time.monotonic() + 10
    while not _can_take(lock_file, fcntl.LOCK_EX) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _can_take(lock_file, fcntl.LOCK_EX), "the lock outlived its holder"


_FAKE_CONFTEST = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests import conftest as strata

strata._cuda_available = lambda: True  # the hooks' GPU branch, without a GPU
strata._gpu_memory_freed = lambda: None
strata._GPU_LOCK_FILE = Path({lock!r})
pytest_collection_modifyitems = strata.pytest_collection_modifyitems
pytest_runtest_protocol = strata.pytest_runtest_protocol


def pytest_configure(config):
    strata.pytest_configure(config)
    config.addinivalue_line("markers", "gpu: a GPU test")
    config.addinivalue_line("markers", "gpu_shared: may share the GPU")
"""

_FAKE_TESTS = """
import json, os, time
import pytest


def _ran(name):
    start = time.monotonic()
    time.sleep(0.4)
    with open({log!r}, "a") as f:
        f.write(json.dumps([name, os.getpid(), start, time.monotonic()]) + "\\n")
"""


def test_under_xdist_the_tests_that_take_the_gpu_alone_run_alone_in_one_process_in_their_order(tmp_path: Path) -> None:
    """A real `pytest -n 3 --dist loadgroup` run of the project's hooks (tests/conftest.py) over tests that only
    sleep and log their time: the ones that take the GPU alone overlap nothing and run in one process in their
    collection order (what a serial run gives them); the shared ones run side by side."""
    pytest.importorskip("xdist")
    log, lock = tmp_path / "ran.jsonl", tmp_path / "gpu.lock"
    (tmp_path / "conftest.py").write_text(_FAKE_CONFTEST.format(root=str(ROOT), lock=str(lock)))
    kinds = ["alone", "shared", "alone", "shared", "shared", "alone", "shared"]
    body = _FAKE_TESTS.format(log=str(log))
    for i, kind in enumerate(kinds):
        marks = "@pytest.mark.gpu\n" + ("@pytest.mark.gpu_shared\n" if kind == "shared" else "")
        body += f"\n\n{marks}def test_{kind}_{i}():\n    _ran('{kind}_{i}')\n"
    (tmp_path / "test_fake_gpu.py").write_text(body)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", "-p", "no:randomly", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {name: (pid, start, end) for name, pid, start, end in map(json.loads, log.read_text().splitlines())}
    assert sorted(runs) == sorted(f"{kind}_{i}" for i, kind in enumerate(kinds))
    alone = [f"alone_{i}" for i, kind in enumerate(kinds) if kind == "alone"]
    assert len({runs[name][0] for name in alone}) == 1, "the tests that take the GPU alone ran in several processes"
    # that process took shared tests too, before the lone ones: it did not sit out the shared phase on the lock
    assert any(runs[name][0] == runs[alone[0]][0] for name in runs if name.startswith("shared")), \
        "the process of the lone tests ran no shared test"
    assert [runs[name][1] for name in alone] == sorted(runs[name][1] for name in alone), "out of their order"
    for name in alone:
        _, start, end = runs[name]
        beside = [other for other, (_, s, e) in runs.items() if other != name and s < end and start < e]
        assert not beside, f"{name} ran beside {beside}"
    shared = [(s, e) for name, (_, s, e) in runs.items() if name.startswith("shared")]
    assert any(s1 < e2 and s2 < e1 for i, (s1, e1) in enumerate(shared) for s2, e2 in shared[i + 1:]), \
        "no two shared tests ran side by side"
