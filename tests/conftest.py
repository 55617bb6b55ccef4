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
