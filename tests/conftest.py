"""Shared test set-up: the `gpu` marker skips without CUDA (checked lazily so torch-free tests stay light);
the `soak` marker skips unless the `-m` expression names it (long runs a developer asks for).

GPU tests may run in parallel processes (`pytest -m gpu -n 4 --dist loadgroup`, pytest-xdist): most of them build
engines whose tier takes the free VRAM, or measure free VRAM, so each takes the GPU alone through a lock file
every process on the machine opens; the ones marked `gpu_shared` (kernels and models against references, and
engine tests of tokens whose engines keep to a few GiB: no VRAM figure) hold it shared, run first, and beside
each other. Their Triton compiles and references are host work, which is why parallel processes shorten the
suite. The tests that take the GPU alone all run in one process, in their collection order (xdist group
`gpu_alone`): what one of them leaves warm for the next (a compiled kernel, torch's pinned-memory cache) is there
as in a serial run. A worker that runs out of tests keeps its process (and its CUDA context) until the whole run
ends, when xdist tears every worker down: no context is freed under a test that measures free VRAM, and a worker
out of tests holds no lock (one held to its exit would keep the tests that take the GPU alone out for good, and
the run would hang)."""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import fcntl
except ImportError:  # not on Windows, where no GPU test of this project runs
    fcntl = None

# One lock for every pytest process of this machine's user: two runs on one GPU take turns as workers do.
_GPU_LOCK_FILE = Path(tempfile.gettempdir()) / "strata-gpu-tests.lock"
_ALONE_GROUP = "gpu_alone"


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, work goes out in collection order (the shared GPU tests first), not largest group first, xdist's
    default: the group of the tests that take the GPU alone, the largest, would go first to one process, which
    would wait out the whole shared phase without running a shared test. In collection order every process takes
    shared tests until they run out."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_soak = pytest.mark.skip(reason="a soak run: select it with -m soak")
    soak_asked = "soak" in (config.getoption("markexpr", default="") or "")
    alone = pytest.mark.xdist_group(_ALONE_GROUP) if config.pluginmanager.hasplugin("xdist") else None
    for item in items:
        if "gpu" in item.keywords and not _cuda_available():
            item.add_marker(skip_gpu)
        if "soak" in item.keywords and not soak_asked:
            item.add_marker(skip_soak)
        if alone is not None and "gpu" in item.keywords and "gpu_shared" not in item.keywords:
            item.add_marker(alone)
    # the GPU tests that share the GPU first (a stable sort: the rest keep their order), so that parallel
    # processes run them side by side before the ones that take the GPU alone queue on the lock
    items.sort(key=lambda item: "gpu_shared" not in item.keywords)


@contextlib.contextmanager
def _gpu_held(shared: bool) -> Iterator[None]:
    """The GPU lock, shared or alone, for the block (a no-op where fcntl is missing)."""
    if fcntl is None:
        yield
        return
    with open(_GPU_LOCK_FILE, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gpu_memory_freed() -> None:
    """GPU tests measure free VRAM (the tier fills it, pressure tests fill it to a margin). An engine a test
    dropped can live on in a reference cycle (bus subscribers, closures) with its KV, its tier and its graphs'
    private pools, which torch counts as cached and the books as free: the next test then sees memory it cannot
    have (a tier that stops GiBs short of full). Collected before and after each test,
    and what this process cached goes back to the driver."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A GPU test holds the lock through its whole protocol: the set-up and tear-down of every fixture it uses,
    whatever their scope (a worker's session checkpoint written, a module's engine closed), so nothing of another
    process runs beside a test that takes the GPU alone. How long it waited for the lock goes to its report
    (`gpu_lock_wait_s`, a property in the JUnit file), so that a test's own time can be told from its wait."""
    if "gpu" not in item.keywords or not _cuda_available():
        yield
        return
    asked_s = time.perf_counter()
    with _gpu_held(shared="gpu_shared" in item.keywords):
        item.user_properties.append(("gpu_lock_wait_s", round(time.perf_counter() - asked_s, 3)))
        _gpu_memory_freed()
        yield
        _gpu_memory_freed()
