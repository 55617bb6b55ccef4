"""The GPU tests' lock (tests/conftest.py): parallel pytest processes (`-m gpu -n 4`) run the tests marked
`gpu_shared` beside each other, and every other GPU test alone. Checked here with real processes and the real
lock file, since what matters is what another process can take while one holds it."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

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


def test_the_gpu_tests_that_share_the_gpu_are_ordered_first_and_the_rest_keep_their_order() -> None:
    def item(name: str, *marks: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, keywords={m: True for m in marks}, add_marker=lambda _mark: None)

    items = [item("cpu_a"), item("alone_1", "gpu"), item("kernel_1", "gpu", "gpu_shared"), item("cpu_b"),
             item("alone_2", "gpu"), item("kernel_2", "gpu", "gpu_shared")]
    config = SimpleNamespace(getoption=lambda name, default=None: "gpu")
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["kernel_1", "kernel_2", "cpu_a", "alone_1", "cpu_b", "alone_2"]
