"""The slowest engine steps of a timed burst, each with what the engine published during it (`bench throughput
--slow-steps N`): where a row's first tokens or inter-token tail went (a capture, the tier giving blocks back, a
KV pool growth, a second-long stall) without running a profiler over the whole burst."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

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

    def __init__(self, drain: Callable[[], list[Any]], keep: int) -> None:
        self.drain = drain
        self.keep = keep
        self.events: list[Any] = []
        self._steps: list[tuple[float, float, int, list[Any]]] = []

    def after_step(self, at_s: float, seconds: float, outputs: int) -> None:
        got = self.drain()
        self.events += got
        if self.keep:
            self._steps.append((at_s, seconds, outputs, got))

    def finish(self) -> None:
        """Keep what was published after the last step (not any step's)."""
        self.events += self.drain()

    def slowest(self) -> list[dict[str, Any]]:
        """The `keep` longest steps in the order they ran: start and length (s), outputs, event counts by
        `type:action`, and the detailed events."""
        longest = sorted(range(len(self._steps)), key=lambda i: -self._steps[i][1])[:self.keep]
        report = []
        for i in sorted(longest):
            at_s, seconds, outputs, events = self._steps[i]
            counts = Counter(f"{e.type}:{getattr(e, 'action', '') or ''}".rstrip(":") for e in events)
            report.append({"step": i, "at_s": round(at_s, 4), "seconds": round(seconds, 4), "outputs": outputs,
                           "events": dict(counts),
                           "details": [describe(e) for e in events if e.type in _DETAILED]})
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
        return out
