"""The COMPILE switch: torch.compile each step function before the graph cache captures it.

Mode: `default` (Inductor kernels, no CUDA graphs of its own). `reduce-overhead` is ruled out because it
captures its own CUDA graphs (cudagraph trees) inside ours, with memory the graph cache cannot account or
free; `max-autotune-no-cudagraphs` benchmarks kernel variants for every bucket at start, which multiplies
start time by the number of buckets for a gain that is not measured yet. Shapes are static per graph key,
so `dynamic=False`. Compilation is lazy: it happens in the capture's warm-up, outside the capture.

When compiling fails (at wrap time, or at the first call, where Dynamo and Inductor really fail), COMPILE is
degraded for the rest of the run: one SwitchEvent and one WarningEvent carrying the real error, and the
step is captured uncompiled. The engine keeps serving.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from engine.exec.gpu_errors import real_message
from engine.switches import SwitchBoard
from engine.telemetry import EventBus

SWITCH = "COMPILE"
DEFAULT_MODE = "default"


class StepCompiler:
    """Wraps step functions with torch.compile while COMPILE is on; degrades the switch on failure."""

    def __init__(self, board: SwitchBoard, bus: EventBus, mode: str = DEFAULT_MODE,
                 compile_fn: Callable[..., Callable] | None = None, options: dict[str, Any] | None = None) -> None:
        self.board = board
        self.bus = bus
        self.mode = mode
        self.options = dict(options or {})
        self._compile_fn = compile_fn
        self._lock = threading.Lock()
        self.failures: list[str] = []

    @property
    def active(self) -> bool:
        """COMPILE is on and has not been degraded."""
        return SWITCH in self.board.states and self.board.enabled(SWITCH)

    def prepare(self, fn: Callable) -> Callable:
        """`fn` compiled when the switch is on, else `fn` itself (the caller compares identities)."""
        if not self.active:
            return fn
        try:
            compile_fn = self._compile_fn
            if compile_fn is None:
                import torch

                compile_fn = torch.compile
            return compile_fn(fn, mode=self.mode, dynamic=False, fullgraph=False, **self.options)
        except Exception as exc:
            self.degrade(real_message(exc), where="compile")
            return fn

    def degrade(self, reason: str, where: str) -> None:
        """Turn COMPILE off for the run with one switch event and one warning (repeats are ignored)."""
        with self._lock:
            if not self.active:
                return
            self.failures.append(reason)
        self.board.degrade(SWITCH, reason, self.bus, where=where, what="torch.compile failed, COMPILE turned off")
