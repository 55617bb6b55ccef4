"""The slowest engine steps of a timed burst, each with what the engine published during it (`bench throughput
--slow-steps N`): where a row's first tokens or inter-token tail went (a capture, the tier giving blocks back, a
KV pool growth, a second-long stall). With `--slow-steps-profile` each step also runs under cProfile and a slow
step names the host functions it spent its time in: what a stall that publishes no event was (a kernel compiled,
an allocation, a synchronization), at the price of slower host work in every step."""

from __future__ import annotations

import cProfile
from collections import Counter
from typing import Any, Callable

PROFILE_FUNCTIONS = 12  # a slow step's functions listed, by their own time

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
        self._steps: list[tuple[float, float, int, list[Any], cProfile.Profile | None]] = []
        self._profiler: cProfile.Profile | None = None

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
        if self.keep:
            self._steps.append((at_s, seconds, outputs, got, profiler))

    def finish(self) -> None:
        """Keep what was published after the last step (not any step's)."""
        self.events += self.drain()

    def slowest(self) -> list[dict[str, Any]]:
        """The `keep` longest steps in the order they ran: start and length (s), outputs, event counts by
        `type:action`, and the detailed events."""
        longest = sorted(range(len(self._steps)), key=lambda i: -self._steps[i][1])[:self.keep]
        report = []
        for i in sorted(longest):
            at_s, seconds, outputs, events, profiler = self._steps[i]
            counts = Counter(f"{e.type}:{getattr(e, 'action', '') or ''}".rstrip(":") for e in events)
            step = {"step": i, "at_s": round(at_s, 4), "seconds": round(seconds, 4), "outputs": outputs,
                    "events": dict(counts), "details": [describe(e) for e in events if e.type in _DETAILED]}
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
            out += [f"    {f['seconds'] * 1e3:9,.1f} ms own {f['cumulative_s'] * 1e3:9,.1f} ms in all "
                    f"{f['calls']:>7,} calls  {f['function']}" for f in s.get("functions", [])]
        return out


def top_functions(profiler: cProfile.Profile, count: int = PROFILE_FUNCTIONS) -> list[dict[str, Any]]:
    """A step's host functions by their own seconds (a kernel launch, a synchronize, a compile, an allocation:
    where the time was spent, not the callers it passed through), with their cumulative seconds and calls."""
    from engine.bench.profile import host_functions  # bench profile's reading of cProfile; it loads the engine

    ranked = sorted(host_functions(profiler), key=lambda f: -f[2])[:count]
    return [{"function": where, "seconds": round(own, 4), "cumulative_s": round(cumulative, 4), "calls": calls}
            for where, calls, own, cumulative in ranked]
