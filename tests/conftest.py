"""Shared test set-up: the `gpu` marker skips without CUDA (checked lazily so torch-free tests stay light);
the `soak` marker skips unless the `-m` expression names it (long runs a developer asks for)."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_soak = pytest.mark.skip(reason="a soak run: select it with -m soak")
    soak_asked = "soak" in (config.getoption("markexpr", default="") or "")
    for item in items:
        if "gpu" in item.keywords and not _cuda_available():
            item.add_marker(skip_gpu)
        if "soak" in item.keywords and not soak_asked:
            item.add_marker(skip_soak)


@pytest.fixture(autouse=True)
def _gpu_memory_of_earlier_tests_freed(request: pytest.FixtureRequest):
    """GPU tests measure free VRAM (the tier fills it, pressure tests fill it to a margin). An engine a test
    dropped can live on in a reference cycle (bus subscribers, closures) with its KV, its tier and its graphs'
    private pools, which torch counts as cached and the books as free: the next test then sees memory it cannot
    have (the 2026-12-01 suite: a tier that stopped 32 GiB short of full). Collect it before and after."""
    if "gpu" not in request.keywords or not _cuda_available():
        yield
        return
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()
