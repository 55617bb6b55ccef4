"""The COMPILE switch: torch.compile each step function before the graph cache captures it.

Mode: `default` (Inductor kernels, no CUDA graphs of its own). `reduce-overhead` is ruled out because it
captures its own CUDA graphs (cudagraph trees) inside ours, with memory the graph cache cannot account or
free; `max-autotune-no-cudagraphs` benchmarks kernel variants for every bucket at start, which multiplies
start time by the number of buckets for a gain that is not measured yet. Shapes are static per graph key,
so `dynamic=False`. Compilation is lazy: it happens in the capture's warm-up, outside the capture.

When compiling fails (at wrap time, or at the first call, where Dynamo and Inductor really fail), COMPILE is
degraded for the rest of the run: one SwitchEvent and one WarningEvent carrying the real error, and the
step is captured uncompiled. The engine keeps serving.

Compiled kernels persist between runs (`compile_cache_dir`): Inductor's FX-graph cache and the Triton kernels
under it are kept in Strata's user cache folder instead of Inductor's default under /tmp, which a reboot or a
tmp cleaner empties, so only the first start of a model shape pays for compiling every bucket. The snapshot's
`graphs` section says where, and how many compiled graphs came from the cache (docs/SWITCHES.md has the figures).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from engine.exec.gpu_errors import real_message
from engine.switches import SwitchBoard
from engine.telemetry import EventBus

SWITCH = "COMPILE"
DEFAULT_MODE = "default"
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # Inductor reads it whenever it resolves its cache folder


def compile_cache_dir() -> str:
    """Where compiled kernels persist: the folder $TORCHINDUCTOR_CACHE_DIR names, else `torch-compile` in
    Strata's user cache folder (platformdirs: ~/.cache/strata on Linux, $XDG_CACHE_HOME honoured). Importing
    torch._dynamo sets the variable to Inductor's /tmp default itself, so that value counts as unset."""
    from platformdirs import user_cache_dir
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get(CACHE_DIR_ENV)
    if named and os.path.abspath(named) != os.path.abspath(default_cache_dir()):
        return named
    return os.path.join(user_cache_dir("strata"), "torch-compile")


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
        self.cache_dir: str | None = None  # set by the first compiled step

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
            if self.cache_dir is None:
                self.cache_dir = os.environ[CACHE_DIR_ENV] = compile_cache_dir()
            if compile_fn is None:
                import torch

                compile_fn = torch.compile
            return compile_fn(fn, mode=self.mode, dynamic=False, fullgraph=False, **self.options)
        except Exception as exc:
            self.degrade(real_message(exc), where="compile")
            return fn

    def cache_stats(self) -> dict[str, Any]:
        """For the snapshot's `graphs` section: the cache folder and this process's compiled-graph cache hits and
        misses (a miss compiled the graph and stored it there); empty before anything was compiled."""
        if self.cache_dir is None:
            return {}
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return {"compile_cache_dir": self.cache_dir, "compile_cache_hits": int(inductor["fxgraph_cache_hit"]),
                "compile_cache_misses": int(inductor["fxgraph_cache_miss"])}

    def degrade(self, reason: str, where: str) -> None:
        """Turn COMPILE off for the run with one switch event and one warning (repeats are ignored)."""
        with self._lock:
            if not self.active:
                return
            self.failures.append(reason)
        self.board.degrade(SWITCH, reason, self.bus, where=where, what="torch.compile failed, COMPILE turned off")
