"""The slowest engine steps of a timed burst, each with what the engine published during it (`bench throughput
--slow-steps N`): where a row's first tokens or inter-token tail went (a capture, the tier giving blocks back, a
KV pool growth, a second-long stall). With `--slow-steps-profile` each step also runs under cProfile and a slow
step names the host functions it spent its time in: what a stall that publishes no event was (a kernel compiled,
an allocation, a synchronization), at the price of slower host work in every step. A Triton kernel compiled during
a step is named with the argument types it was specialized for (Triton's post-compile hook): a first-seen shape in
the timed burst is a compile its warm-up missed."""

from __future__ import annotations

import cProfile
from collections import Counter
from typing import Any, Callable

PROFILE_FUNCTIONS = 12  # a slow step's functions listed, by their own time
COMPILED_CHARS = 400  # of a compiled kernel's description (its argument types can run long)

# Events worth their details in a slow step; the others (slot progress, admissions) are counted only.
_DETAILED = ("graph", "tier", "kv", "expert", "warning", "error", "engine")
_FIELDS = ("kind", "key", "blocks", "mib", "total_mib", "ms", "reason", "message", "error")


def describe(event: Any) -> str:
    """One event as `type action field=value ...` (the fields it has and that are set)."""
    parts = [event.type, getattr(event, "action", "") or ""]
    for name in _FIELDS:
        value = getattr(event, name, None)
        if value not in (None, "", 0, 0.0, []):
            parts.append(f"{name}={round(value, 1) if isinstance(value, float) else value}")
    return " ".join(p for p in parts if p)


class StepTrace:
    """Fed after every step of a burst (`after_step`); keeps every event (the row's one-time work reads them)
    and, for `keep` > 0, each step's time and events, of which `slowest` reports the `keep` longest."""

    def __init__(self, drain: Callable[[], list[Any]], keep: int, profile: bool = False) -> None:
        self.drain = drain
        self.keep = keep
        self.profile = profile and keep > 0
        self.events: list[Any] = []
        self._steps: list[tuple[float, float, int, list[Any], cProfile.Profile | None, list[str]]] = []
        self._profiler: cProfile.Profile | None = None
        self._compiled: list[str] = []
        self._unhook: Callable[[], None] | None = self._hook_compiles() if keep > 0 else None

    def _hook_compiles(self) -> Callable[[], None] | None:
        """Record each Triton kernel compiled from now on (chained to a hook already set); returns the undo."""
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs: no compile is named
            return None
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            self._compiled.append(compiled_name(kwargs))
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return lambda: setattr(knobs.runtime, "jit_post_compile_hook", previous)

    def before_step(self) -> None:
        if self.profile:
            self._profiler = cProfile.Profile()
            self._profiler.enable()

    def after_step(self, at_s: float, seconds: float, outputs: int) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.disable()
        got = self.drain()
        self.events += got
        compiled, self._compiled = self._compiled, []
        if self.keep:
            self._steps.append((at_s, seconds, outputs, got, profiler, compiled))

    def finish(self) -> None:
        """Keep what was published after the last step (not any step's); stop naming compiles."""
        self.events += self.drain()
        if self._unhook is not None:
            self._unhook()
            self._unhook = None

    def slowest(self) -> list[dict[str, Any]]:
        """The `keep` longest steps in the order they ran: start and length (s), outputs, event counts by
        `type:action`, and the detailed events."""
        longest = sorted(range(len(self._steps)), key=lambda i: -self._steps[i][1])[:self.keep]
        report = []
        for i in sorted(longest):
            at_s, seconds, outputs, events, profiler, compiled = self._steps[i]
            counts = Counter(f"{e.type}:{getattr(e, 'action', '') or ''}".rstrip(":") for e in events)
            step = {"step": i, "at_s": round(at_s, 4), "seconds": round(seconds, 4), "outputs": outputs,
                    "events": dict(counts), "details": [describe(e) for e in events if e.type in _DETAILED],
                    "compiled": compiled}
            if profiler is not None:
                step["functions"] = top_functions(profiler)
            report.append(step)
        return report

    @staticmethod
    def lines(concurrency: int, steps: list[dict[str, Any]]) -> list[str]:
        """The report as text, one step a line and its details indented."""
        out = [f"slowest steps at {concurrency} concurrent:"]
        for s in steps:
            counts = ", ".join(f"{k} x{v}" for k, v in sorted(s["events"].items()))
            out.append(f"  step {s['step']} at {s['at_s'] * 1e3:,.0f} ms: {s['seconds'] * 1e3:,.1f} ms, "
                       f"{s['outputs']} outputs; {counts or 'no events'}")
            out += [f"    {d}" for d in s["details"]]
            out += [f"    triton compiled {c}" for c in s.get("compiled", [])]
            out += [f"    {f['seconds'] * 1e3:9,.1f} ms own {f['cumulative_s'] * 1e3:9,.1f} ms in all "
                    f"{f['calls']:>7,} calls  {f['function']}" for f in s.get("functions", [])]
        return out


def compiled_name(hook_kwargs: dict[str, Any]) -> str:
    """A compile as Triton's hook describes it: the kernel, its launch options and the argument types it was
    specialized for (`repr`), cut to COMPILED_CHARS."""
    return str(hook_kwargs.get("repr") or getattr(hook_kwargs.get("fn"), "name", "a Triton kernel"))[:COMPILED_CHARS]


def top_functions(profiler: cProfile.Profile, count: int = PROFILE_FUNCTIONS) -> list[dict[str, Any]]:
    """A step's host functions by their own seconds (a kernel launch, a synchronize, a compile, an allocation:
    where the time was spent, not the callers it passed through), with their cumulative seconds and calls."""
    from engine.bench.profile import host_functions  # bench profile's reading of cProfile; it loads the engine

    ranked = sorted(host_functions(profiler), key=lambda f: -f[2])[:count]
    return [{"function": where, "seconds": round(own, 4), "cumulative_s": round(cumulative, 4), "calls": calls}
            for where, calls, own, cumulative in ranked]
