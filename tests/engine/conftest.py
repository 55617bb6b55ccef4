"""Fixtures for engine tests: random-weight checkpoints written by engine.model.random_checkpoint.

`tiny_checkpoint` is a Qwen3 tiny checkpoint with a DeepSeek-layout MTP head and a working tokenizer, written
once per test session; `make_checkpoint(**kwargs)` writes (and caches) any other write_random_checkpoint variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: make_checkpoint(arch="qwen3", mtp_layout=None, size="tiny", dtype="float32", seed=0, **overrides)."""
    from engine.model.random_checkpoint import write_random_checkpoint

    cache: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            cache[key] = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    """A tiny Qwen3 checkpoint (fp32, tied head, 1 DeepSeek MTP layer, toy BPE tokenizer)."""
    return make_checkpoint(arch="qwen3", mtp_layout="deepseek", size="tiny")
