"""Fault injection for tests: make the Nth capture or instantiate of a graph kind fail with a real error.

The out-of-memory path of the graph cache only runs when VRAM is exhausted at the wrong moment, which a
test cannot arrange reliably on a GPU and never on a CPU. A FaultPlan makes it happen on purpose; the product
never builds one. A test passes one to a GraphCache (`fault_plan=`), installs one for the caches an engine
builds in process (`installed`), or starts an engine process with one (`engine_process_env`: the process
runs tests/fault_site/sitecustomize.py, which installs the plan before the engine starts):

    FaultPlan.parse("capture:draft_round:1:oom,instantiate:verify:2+:sticky")

Each rule is `stage:kind:when:error`, comma separated:
  stage  `capture` (while the stream records the step) or `instantiate` (after capture ended)
  kind   a graph kind (`decode`, `verify`, `draft_prefill`, `draft_round`, `draft_step`) or `*`
  when   `N` (only the Nth attempt of that stage and kind, from 1), `N+` (the Nth and every later one),
         `N-M` (attempts N to M) or `*` (every attempt)
  error  one of ERRORS below

The injected errors are the exception types and messages CUDA and PyTorch really raise, each suffixed with
`[injected ...]` so a log never passes one off as a real failure.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

from engine.errors import ConfigError

ENV_VAR = "STRATA_FAULT_INJECT"  # read by tests/fault_site/sitecustomize.py in an engine process a test starts
SITE_DIR = Path(__file__).resolve().parent / "fault_site"
STAGES = ("capture", "instantiate")

_DRIVER_OOM = "CUDA error: out of memory"
_ALLOC_OOM = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.81 GiB "
              "of which 2.00 MiB is free.")
_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
# torch's tail on every CUDA error, its last line included, so that the fault-injection tests meet the real text:
# "device-side assertions" in it must not make an error look sticky to engine.exec.gpu_errors.
_BOILERPLATE = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
                "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
                "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def _oom_type() -> type[RuntimeError]:
    try:
        import torch

        return torch.OutOfMemoryError
    except (ImportError, AttributeError):  # keep the plan usable where torch is absent
        return RuntimeError


def _alloc_oom(tag: str) -> BaseException:
    return _oom_type()(f"{_ALLOC_OOM} {tag}")


def _driver_oom(tag: str) -> BaseException:
    return RuntimeError(f"{_DRIVER_OOM} {tag}{_BOILERPLATE}")


def _stage_oom(stage: str, tag: str) -> BaseException:
    # What each stage really raises: the caching allocator during capture, the driver at instantiate.
    return _alloc_oom(tag) if stage == "capture" else _driver_oom(tag)


def _invalidated(stage: str, tag: str) -> BaseException:
    outer = RuntimeError(f"{_INVALIDATED} {tag}{_BOILERPLATE}")
    outer.__cause__ = _alloc_oom(tag)
    return outer


def _no_error(stage: str, tag: str) -> BaseException:
    # The seed bug: a success status from another call reported in place of the failure that caused it.
    outer = RuntimeError(f"mtp: round capture: no error {tag}")
    outer.__context__ = _stage_oom(stage, tag)
    return outer


ERRORS: dict[str, Callable[[str, str], BaseException]] = {
    "oom": _stage_oom,
    "alloc_oom": lambda stage, tag: _alloc_oom(tag),
    "driver_oom": lambda stage, tag: _driver_oom(tag),
    "invalidated": _invalidated,
    "no_error": _no_error,
    "empty": lambda stage, tag: RuntimeError(),
    "sticky": lambda stage, tag: RuntimeError(f"CUDA error: an illegal memory access was encountered {tag}{_BOILERPLATE}"),
    "assert": lambda stage, tag: RuntimeError(f"CUDA error: device-side assert triggered {tag}{_BOILERPLATE}"),
    "unsupported": lambda stage, tag: RuntimeError(
        f"CUDA error: operation not permitted when stream is capturing {tag}{_BOILERPLATE}"),
}


@dataclass(frozen=True)
class FaultRule:
    """Fail attempts `first..last` (inclusive; `last=None` means forever) of `stage` for `kind`."""

    stage: str
    kind: str
    first: int
    last: int | None
    error: str

    def matches(self, stage: str, kind: str, attempt: int) -> bool:
        if stage != self.stage or (self.kind != "*" and kind != self.kind):
            return False
        return attempt >= self.first and (self.last is None or attempt <= self.last)

    def spec(self) -> str:
        when = "*" if (self.first, self.last) == (1, None) else (
            f"{self.first}+" if self.last is None else
            str(self.first) if self.first == self.last else f"{self.first}-{self.last}")
        return f"{self.stage}:{self.kind}:{when}:{self.error}"


@dataclass
class FaultPlan:
    """A set of rules plus per-(stage, kind) attempt counters. `check` is called by the graph backends."""

    rules: list[FaultRule] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)  # what fired, for tests and logs
    _counts: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def parse(cls, spec: str, source: str = ENV_VAR) -> "FaultPlan":
        """Parse `stage:kind:when:error[,...]`; a malformed rule raises ConfigError naming it."""
        rules = [_parse_rule(part.strip(), source) for part in spec.split(",") if part.strip()]
        return cls(rules=rules)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "FaultPlan | None":
        spec = environ.get(ENV_VAR, "").strip()
        return cls.parse(spec) if spec else None

    def install(self) -> None:
        """The plan of every GraphCache built without one from now on (engine.exec.graphs.cache.installed_faults)."""
        import engine.exec.graphs.cache as graph_cache

        graph_cache.installed_faults = self

    def check(self, stage: str, kind: str) -> None:
        """Count one attempt of `stage` for `kind`; raise the planned error if a rule covers it."""
        with self._lock:
            n = self._counts.get((stage, kind), 0) + 1
            self._counts[(stage, kind)] = n
            rule = next((r for r in self.rules if r.matches(stage, kind, n)), None)
            if rule is not None:
                self.fired.append(f"{stage}:{kind}:{n}:{rule.error}")
        if rule is not None:
            raise ERRORS[rule.error](stage, f"[injected {rule.spec()} attempt {n}]")

    def attempts(self, stage: str, kind: str) -> int:
        with self._lock:
            return self._counts.get((stage, kind), 0)


def _parse_rule(text: str, source: str) -> FaultRule:
    parts = text.split(":")
    if len(parts) != 4:
        raise ConfigError(source, text, "expected stage:kind:when:error, e.g. capture:draft_round:1:oom")
    stage, kind, when, error = (p.strip() for p in parts)
    if stage not in STAGES:
        raise ConfigError(source, text, f"stage {stage!r} is not one of {', '.join(STAGES)}")
    if not kind:
        raise ConfigError(source, text, "kind is empty (use * for every kind)")
    if error not in ERRORS:
        raise ConfigError(source, text, f"error {error!r} is not one of {', '.join(ERRORS)}")
    try:
        if when == "*":
            first, last = 1, None
        elif when.endswith("+"):
            first, last = int(when[:-1]), None
        elif "-" in when:
            lo, hi = when.split("-", 1)
            first, last = int(lo), int(hi)
        else:
            first = last = int(when)
    except ValueError:
        raise ConfigError(source, text, f"when {when!r} is not N, N+, N-M or *") from None
    if first < 1 or (last is not None and last < first):
        raise ConfigError(source, text, f"when {when!r}: attempts count from 1 and N-M needs M >= N")
    return FaultRule(stage, kind, first, last, error)


@contextlib.contextmanager
def installed(spec: str) -> Iterator[FaultPlan]:
    """The engines built inside get `spec`'s faults in their graph caches; none afterwards."""
    import engine.exec.graphs.cache as graph_cache

    plan = FaultPlan.parse(spec)
    before, graph_cache.installed_faults = graph_cache.installed_faults, plan
    try:
        yield plan
    finally:
        graph_cache.installed_faults = before


def engine_process_env(spec: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process (python -m engine.cli ..., or one a TUI starts) that fails graph
    captures as `spec` says: tests/fault_site on PYTHONPATH, whose sitecustomize installs the plan."""
    env = dict(os.environ if environ is None else environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), path) if p)
    env[ENV_VAR] = FaultPlan.parse(spec) and spec  # a malformed spec fails here, in the test, not in the child
    return env
