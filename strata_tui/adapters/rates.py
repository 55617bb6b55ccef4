"""Token rates from token counters over time, per endpoint.

A rate gauge is not always there, and not always right: llama.cpp's `predicted_tokens_seconds` is the mean rate of
the requests that finished since the last scrape (a slot adds its tokens when its request ends; a scrape starts the
window again), so it reads 0 while four slots decode; vLLM exports no rate at all. Counters
(`*_tokens_total`) only grow: the difference between two readings over the time between them is what flowed,
whatever the gauges say. The first reading has nothing to compare with (None: "measuring"); a counter that went
down (the server restarted) starts again from there."""

from __future__ import annotations

import time
from typing import Callable


class CounterRates:
    """The last reading of each counter an endpoint exports, and the per-second rates since the one before."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, tuple[float, float]] = {}  # counter -> (monotonic seconds, value)

    def rate(self, name: str, value: float | None) -> float | None:
        """Tokens a second of counter `name` since its last reading; None on its first reading, after a reset or
        when the endpoint does not export it (`value` None)."""
        if value is None:
            self._last.pop(name, None)
            return None
        now = self._clock()
        before = self._last.get(name)
        self._last[name] = (now, value)
        if before is None or value < before[1] or now <= before[0]:
            return None
        return (value - before[1]) / (now - before[0])
