"""How long a prompt's prefill has left (`SlotEvent.eta_s`): a cost per token that grows with its position,
fitted to the chunks that ran. Pure Python.

The model (engine/prefill_cost.py, shared with strata-tui): a token at position p costs about `a + b·p`. A
constant rate (tokens so far / time so far) promises the back half
of a long prompt at the front half's speed: at 12K tokens on a CPU it said half the time that was left.
`PrefillClock` keeps (tokens with KV, time) after each chunk, from admission on, fits a and b (least squares,
both >= 0) to the last chunks' wall times (decode steps between the chunks included: they are part of the wait),
leaves out the chunks far over the fit (one-time costs: engine/prefill_cost.py) and integrates the rest of the
prompt.
"""

from __future__ import annotations

from collections import deque

from engine.prefill_cost import fit_chunks, span_cost_s

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
        return fit_chunks([(x0, x1, t1 - t0) for (x0, t0), (x1, t1) in zip(points, points[1:])])

    def remaining_s(self, from_tokens: int, total_tokens: int) -> float | None:
        """Predicted seconds for prompt positions [from_tokens, total_tokens)."""
        if from_tokens >= total_tokens:
            return 0.0
        model = self.cost()
        if model is None:
            return None
        return span_cost_s(*model, from_tokens, total_tokens)

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

