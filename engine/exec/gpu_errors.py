"""Classify GPU errors and extract the real message from an exception chain.

The seed report's first bug was a log line that said `no error`: the status printed came from another CUDA
call than the one that failed. Here every message is built from the exception actually raised, walking its
`__cause__`/`__context__` chain (a failed capture surfaces as "operation failed due to a previous error
during capture" whose cause is the out-of-memory; a failed instantiate surfaces as a plain RuntimeError
"CUDA error: out of memory", not `torch.OutOfMemoryError`). A message that is empty or says "no error" is
never emitted: it falls back to the exception type and a sanitized repr.

Import-light on purpose (torch is imported only by `vram_free_mib`), so the classification is usable and
testable anywhere.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from engine.telemetry import ErrorEvent

# Lines PyTorch appends to every CUDA error; they say nothing about this failure.
_BOILERPLATE = (
    "cuda kernel errors might be asynchronously reported",
    "for debugging consider passing cuda_launch_blocking",
    "compile with `torch_use_cuda_dsa`",
    "device-side assertions",
    "search for `cudaerror",
)
# The caching allocator's OOM text ends with generic tuning advice; the figures before it are the news.
_ALLOCATOR_ADVICE = "If reserved but unallocated memory is large"
_OOM_PATTERNS = re.compile(
    r"out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
    r"|CUDA_ERROR_OUT_OF_MEMORY|memory allocation failed",
    re.IGNORECASE,
)
# Errors after which the CUDA context is unusable: every later call fails, so the process must restart.
_STICKY_PATTERNS = re.compile(
    r"illegal memory access|illegal address|device-side assert|unspecified launch failure|launch timed out"
    r"|misaligned address|illegal instruction|hardware stack error|uncorrectable ECC|an ECC error"
    r"|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress|cudaErrorAssert|cudaErrorLaunchFailure"
    r"|invalid program counter|GPU has fallen off the bus|unrecoverable",
    re.IGNORECASE,
)
_NO_ERROR = re.compile(r"no error", re.IGNORECASE)


class StickyCudaError(RuntimeError):
    """A CUDA error that poisons the context (illegal address, device assert, launch failure).

    Not recoverable in-process: the engine reports it as `ErrorEvent(fatal=True)`, answers 503 on /health
    and exits non-zero so the launcher can offer a restart.
    """

    def __init__(self, where: str, exc_type: str, message: str, vram_free_mib: float | None) -> None:
        self.where = where
        self.exc_type = exc_type
        self.message = message
        self.vram_free_mib = vram_free_mib
        super().__init__(f"{where}: sticky CUDA error: {message}")

    def to_event(self) -> ErrorEvent:
        """The fatal ErrorEvent the engine publishes before it stops."""
        return ErrorEvent(where=self.where, exc_type=self.exc_type, message=self.message,
                          vram_free_mib=self.vram_free_mib, fatal=True)


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then its causes and contexts, depth first, each once (chains can be cyclic)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        # Context first onto the stack so the explicit cause is visited first.
        for nxt in (cur.__context__, cur.__cause__):
            if nxt is not None:
                stack.append(nxt)


def _clean_text(exc: BaseException) -> str:
    """The informative lines of one exception's message, joined on one line."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if not any(b in ln.lower() for b in _BOILERPLATE)]
    joined = " ".join(keep)
    advice = joined.find(_ALLOCATOR_ADVICE)
    return joined[:advice].rstrip() if advice > 0 else joined


def _usable(text: str) -> bool:
    return bool(text) and not _NO_ERROR.search(text)


def is_oom(exc: BaseException) -> bool:
    """True when any exception in the chain is an out-of-memory (allocator or driver side)."""
    for link in exception_chain(exc):
        if type(link).__name__ == "OutOfMemoryError" or _OOM_PATTERNS.search(_clean_text(link)):
            return True
    return False


def is_sticky(exc: BaseException) -> bool:
    """True when any exception in the chain is a context-poisoning CUDA error."""
    if isinstance(exc, StickyCudaError):
        return True
    # The cleaned text: torch ends every CUDA error with "... to enable device-side assertions", which would
    # otherwise make an out-of-memory or a broken capture look context-poisoning.
    return any(_STICKY_PATTERNS.search(_clean_text(link)) for link in exception_chain(exc))


def classify(exc: BaseException) -> str:
    """`sticky`, `oom` or `other`. Sticky wins: after one, nothing else on the device can be trusted."""
    if is_sticky(exc):
        return "sticky"
    if is_oom(exc):
        return "oom"
    return "other"


def real_message(exc: BaseException) -> str:
    """`Type: message` of the raised exception, plus `(caused by Type: message)` for each usable link.

    Links whose message is empty or says "no error" are skipped: they are a status from another call, not
    the failure. If no link is usable, the result is the type name and a repr with that phrase replaced,
    so the text can never be empty and never claims there was no error.
    """
    parts: list[str] = []
    for link in exception_chain(exc):
        text = _clean_text(link)
        if _usable(text):
            entry = f"{type(link).__name__}: {text}"
            if not any(entry in p for p in parts):  # a wrapper that quotes its cause already says it
                parts.append(entry)
    if not parts:
        shown = _NO_ERROR.sub("a success status", repr(exc)) or type(exc).__name__
        return f"{type(exc).__name__} without a usable message (repr {shown})"
    head, rest = parts[0], parts[1:]
    return head + "".join(f" (caused by {p})" for p in rest)


def vram_free_mib(device: Any = None) -> float | None:
    """Free device memory right now, from the driver (`cudaMemGetInfo`); None without CUDA or when the
    context is too broken to answer."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            return None
        free_b, _total_b = torch.cuda.mem_get_info(dev)
        return free_b / (1 << 20)
    except Exception:  # a sticky error makes every call fail; report "unknown" instead of a second error
        return None


def sticky_from(exc: BaseException, where: str, device: Any = None) -> StickyCudaError:
    """Wrap a sticky error with its real message and the VRAM free now (None if the context is gone)."""
    if isinstance(exc, StickyCudaError):
        return exc
    return StickyCudaError(where, type(exc).__name__, real_message(exc), vram_free_mib(device))


def error_event(exc: BaseException, where: str, device: Any = None) -> ErrorEvent:
    """The ErrorEvent for any exception: real message, VRAM free now, fatal when sticky."""
    if isinstance(exc, StickyCudaError):
        return exc.to_event()
    return ErrorEvent(where=where, exc_type=type(exc).__name__, message=real_message(exc),
                      vram_free_mib=vram_free_mib(device), fatal=is_sticky(exc))
