"""The real error in a vLLM, SGLang or llama.cpp log: each engine's root cause, not the wrapper line after it.

vLLM's API server ends a failed start with "RuntimeError: Engine core initialization failed. See root cause
above"; the root cause (a CUDA OOM in the engine core's traceback) is above it. llama.cpp logs the
allocation that failed ("failed to allocate buffer of size N"), then several lines that only repeat that
loading stopped. So each engine has its causes in order of preference; the last line matching the first
pattern that matches anywhere is the one shown."""

from __future__ import annotations

import re
from typing import Iterable

_COMMON = (re.compile(r"Address already in use|couldn't bind|failed to bind", re.I),)
CAUSES: dict[str, tuple[re.Pattern[str], ...]] = {
    "vllm": (
        re.compile(r"OutOfMemoryError: CUDA out of memory|CUDA out of memory"),
        re.compile(r"CUDA error: .+"),
        re.compile(r"ValueError: .+|No available memory for the cache blocks"),
        *_COMMON,
        re.compile(r"^(\w+\.)*\w*(Error|Exception): (?!Engine core initialization failed)"),
    ),
    "sglang": (
        re.compile(r"OutOfMemoryError: CUDA out of memory|CUDA out of memory|Not enough memory"),
        re.compile(r"CUDA error: .+"),
        re.compile(r"ValueError: .+"),
        *_COMMON,
        re.compile(r"^(\w+\.)*\w*(Error|Exception): "),
    ),
    "llamacpp": (
        re.compile(r"failed to allocate .*of size"),
        re.compile(r"failed to allocate"),
        re.compile(r"error loading model|failed to open|failed to read|invalid magic", re.I),
        *_COMMON,
        re.compile(r"\berror\b", re.I),
    ),
}


def pick_engine_error(kind: str, lines: Iterable[str]) -> str | None:
    """The line that says why `kind`'s server failed, or None when none of its causes appears."""
    text = [line.strip() for line in lines if line.strip()]
    for pattern in CAUSES.get(kind, ()):
        for line in reversed(text):
            if pattern.search(line):
                return line[:300]
    return None
