"""How long a prompt's prefill has left (`SlotEvent.eta_s`): a cost per token that grows with its position,
fitted to the chunks that ran. Pure Python.

A prompt token at position p attends to the p keys before it, so it costs about `a + b·p` and a chunk from x0
to x1 costs `a·(x1 - x0) + b/2·(x1² - x0²)`. A constant rate (tokens so far / time so far) promises the back half
of a long prompt at the front half's speed: at 12K tokens on a CPU it said half the time that was left.
`PrefillClock` keeps (tokens with KV, time) after each chunk, from admission on, fits a and b (least squares,
both >= 0) to the last chunks' wall times (decode steps between the chunks included: they are part of the wait)
and integrates the rest of the prompt.
"""

from __future__ import annotations

from collections import deque

MAX_CHUNKS = 64  # the fit's window: enough chunks to see the slope, recent enough to follow a change of pace


class PrefillClock:
    """(tokens with KV, monotonic time) from admission, after every chunk that ran."""

    def __init__(self, start_tokens: int, start_s: float) -> None:
        self.samples: deque[tuple[int, float]] = deque([(start_tokens, start_s)], maxlen=MAX_CHUNKS + 1)

    def ran(self, tokens: int, now_s: float) -> None:
        """A chunk finished: `tokens` of the prompt have KV now."""
        if tokens > self.samples[-1][0] and now_s >= self.samples[-1][1]:
            self.samples.append((tokens, now_s))

    def cost(self) -> tuple[float, float] | None:
        """(a s/token, b s/token²) fitted to the chunks so far; None before the first chunk."""
        points = list(self.samples)
        rows = [(float(x1 - x0), (x1 * x1 - x0 * x0) / 2.0, t1 - t0)
                for (x0, t0), (x1, t1) in zip(points, points[1:])]
        return fit_nonnegative(rows) if rows else None

    def remaining_s(self, from_tokens: int, total_tokens: int) -> float | None:
        """Predicted seconds for prompt positions [from_tokens, total_tokens)."""
        if from_tokens >= total_tokens:
            return 0.0
        model = self.cost()
        if model is None:
            return None
        a, b = model
        return a * (total_tokens - from_tokens) + b / 2.0 * (total_tokens ** 2 - from_tokens ** 2)

    def eta_s(self, total_tokens: int, now_s: float) -> float | None:
        """Seconds left at `now_s`: the rest of the prompt from the last chunk's end, less the time since it ended.
        A chunk that runs longer than predicted holds the estimate at what the chunks after it will take."""
        x, at_s = self.samples[-1]
        left_s = self.remaining_s(x, total_tokens)
        if left_s is None:
            return None
        step = x - self.samples[-2][0] if len(self.samples) > 1 else 0
        after_next_s = self.remaining_s(min(total_tokens, x + step), total_tokens) or 0.0
        return max(after_next_s, left_s - max(0.0, now_s - at_s))


def fit_nonnegative(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares for dt = a·u + b·v with a, b >= 0 over rows (u, v, dt), in closed form.

    Unweighted (absolute seconds): the latest, longest chunks count most, and they are what the rest of the
    prompt resembles. With one chunk (or chunks that cannot tell a from b) one term is fitted: the constant rate."""
    s11 = s12 = s22 = r1 = r2 = 0.0
    for u, v, dt in rows:
        s11 += u * u
        s12 += u * v
        s22 += v * v
        r1 += u * dt
        r2 += v * dt
    det = s11 * s22 - s12 * s12
    if det > 1e-9 * max(s11 * s22, 1e-300):
        a = (r1 * s22 - r2 * s12) / det
        b = (s11 * r2 - s12 * r1) / det
        if a >= 0 and b >= 0:
            return a, b
    a_only = r1 / s11 if s11 else 0.0
    b_only = r2 / s22 if s22 else 0.0
    err_a = sum((dt - a_only * u) ** 2 for u, _, dt in rows)
    err_b = sum((dt - b_only * v) ** 2 for _, v, dt in rows)
    return (max(a_only, 0.0), 0.0) if err_a <= err_b else (0.0, max(b_only, 0.0))
