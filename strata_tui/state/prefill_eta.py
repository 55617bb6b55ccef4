"""How long a long prompt's prefill has left, and how long it took. Pure Python.

The engine reports, per slot, how many prompt tokens have KV so far (cached + prefilled, published after
each step) and a time stamp. A chunk of prefill costs more the later it comes: every token attends to all
the tokens before it, so the cost of the token at position p grows like `a + b·p`, and a chunk from x0
to x1 costs `a·(x1 - x0) + b/2·(x1² - x0²)`. `PrefillTrack` fits a and b (least squares, both >= 0) to the
chunks seen so far, leaving out those far over the fit (one-time costs such as a kernel compiled for a new
chunk size beside decoding slots: engine/prefill_cost.py), and integrates the rest of the prompt; a constant
rate would promise the back half at the front half's speed. Between events the estimate counts down on the local
clock, so the number on screen moves every refresh instead of freezing for a chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.prefill_cost import fit_chunks, span_cost_s

MAX_SAMPLES = 256
CURVE_FROM_CHUNKS = 4  # chunks that ran before the growing-cost curve is fitted (the mean rate before)
MAX_STEP = 2.0  # what is shown moves by at most this factor between two refreshes, beyond counting down
MIN_DAMPED_S = 1.0  # under this many seconds the count goes as it will
# An ETA is shown once a second chunk has run: the first pays one-time costs (kernels compiled for its size, graphs
# captured, the admission's hashing) that the rest of the prompt does not, and on a fresh GPU engine an ETA made
# from it alone promised minutes for a prompt done in a second (docs/TUI.md).
FIRST_ETA_SAMPLES = 3


@dataclass
class PrefillTrack:
    """One request's prefill: samples of (engine time, tokens with KV, local receive time)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    admitted_ts: float | None = None  # engine clock
    samples: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    engine_eta_s: float | None = None  # the engine's own constant-rate estimate at the last sample
    first_token_ts: float | None = None
    ttft_s: float | None = None  # admission to first token
    prompt_tok_s: float | None = None  # prompt tokens computed (cached excluded) per second until then
    _shown: tuple[float, float] | None = field(default=None, repr=False)  # (local time, ETA) last shown

    @property
    def to_prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def computed_tokens(self) -> int:
        return self.samples[-1][1] if self.samples else self.cached_tokens

    @property
    def progress(self) -> float:
        """Fraction of the tokens that need prefilling (cached ones excluded) done, 0..1."""
        if self.to_prefill_tokens == 0:
            return 1.0
        done = self.computed_tokens - self.cached_tokens
        return min(1.0, max(0.0, done / self.to_prefill_tokens))

    @property
    def done(self) -> bool:
        return self.first_token_ts is not None

    def add(self, engine_ts: float, computed_tokens: int, received_s: float, engine_eta_s: float | None = None,
            chunk_ran: bool = True, chunk_tok_s: float | None = None) -> None:
        """A progress report. Repeats (no new tokens) only refresh the engine's estimate. `chunk_ran`
        False: the report was made when the first chunk was planned, before it ran (the engine counts
        planned tokens as computed then), so it says nothing about cost yet. `chunk_tok_s`: the engine's prefill
        rate with this report (how long its first chunk took, where the time stamps cannot say)."""
        self.engine_eta_s = engine_eta_s
        if not chunk_ran:
            if self.admitted_ts is None:
                self.admitted_ts = engine_ts
            return
        if self.samples and computed_tokens <= self.samples[-1][1]:
            return
        if not self.samples and computed_tokens > self.cached_tokens:
            # The first report already covers a chunk that ran: its start is a cost sample too. The admission event
            # is published with the step that ran the chunk, stamped after it (0.1 ms before the chunk's report on
            # CPU, after a 3.9 s chunk): a first chunk fitted as free made the fit all quadratic (+131 % at
            # halfway, and a 0 s ETA jumping to 71 s). The engine's rate for the chunk says when it started.
            start = self.admitted_ts
            if chunk_tok_s:
                ran_s = (computed_tokens - self.cached_tokens) / chunk_tok_s
                start = min(start, engine_ts - ran_s) if start is not None else engine_ts - ran_s
            if start is not None:
                self.samples.append((start, self.cached_tokens, received_s))
        self.samples.append((engine_ts, computed_tokens, received_s))

    def first_token(self, engine_ts: float, engine_prompt_tok_s: float | None = None) -> None:
        if self.first_token_ts is not None:
            return
        self.first_token_ts = engine_ts
        start = self.admitted_ts if self.admitted_ts is not None else (self.samples[0][0] if self.samples else None)
        span_s = engine_ts - start if start is not None and engine_ts > start else None
        # The events of one step are published together after it: a prompt prefilled in one chunk has its admission
        # and its first token stamped a fraction of a millisecond apart. The engine's own prompt rate says how long
        # the chunk took; the time to first token is never shorter than that.
        rate_s = self.to_prefill_tokens / engine_prompt_tok_s if engine_prompt_tok_s else None
        if span_s is not None or rate_s is not None:
            self.ttft_s = max(span_s or 0.0, rate_s or 0.0)
            self.prompt_tok_s = engine_prompt_tok_s or (self.to_prefill_tokens / self.ttft_s if self.ttft_s else None)

    def cost_model(self) -> tuple[float, float] | None:
        """(a s/token, b s/token²) fitted to the chunks seen; None before two samples."""
        points = list(self.samples)
        return fit_chunks([(x0, x1, t1 - t0) for (t0, x0, _), (t1, x1, _) in zip(points, points[1:])])

    def eta_s(self, now_received_s: float) -> float | None:
        """Seconds left, counted down from the last report on the local clock; None without an estimate.

        A chunk that runs longer than predicted does not drive the count below what the chunks after it
        will take: the estimate waits there for the next report instead of showing 0. And what is shown moves by
        at most MAX_STEP times between two refreshes beyond counting down: a noisy chunk (a loaded CPU ran one
        chunk in 0.5 s and the next in 12 s) once made the ETA jump from 50 s to 27 minutes and back; a real
        change still shows within a few refreshes (2x a refresh: 16x a second)."""
        if self.done or len(self.samples) < FIRST_ETA_SAMPLES:
            return None
        _, x, received_s = self.samples[-1]
        remaining_s = self._remaining_from(x)
        if remaining_s is None:
            return None
        step = x - self.samples[-2][1] if len(self.samples) > 1 else 0
        after_current_s = self._remaining_from(min(self.prompt_tokens, x + step)) if step else 0.0
        eta = max(after_current_s or 0.0, remaining_s - (now_received_s - received_s))
        if self._shown is not None and now_received_s > self._shown[0]:
            counted_down = max(MIN_DAMPED_S, self._shown[1] - (now_received_s - self._shown[0]))
            eta = min(max(eta, counted_down / MAX_STEP), counted_down * MAX_STEP) if eta > MIN_DAMPED_S else eta
        if self._shown is None or now_received_s >= self._shown[0]:
            self._shown = (now_received_s, eta)
        return eta

    def _remaining_from(self, x: int) -> float | None:
        total = self.prompt_tokens
        if x >= total:
            return 0.0
        if len(self.samples) - 1 < CURVE_FROM_CHUNKS:
            # A few noisy chunks cannot tell a growing cost from noise (1.7 s, 4.9 s, 12.2 s fitted as all
            # quadratic promised 27 minutes for an 8K prompt): the mean rate so far until there are more, the first
            # chunk left out (FIRST_ETA_SAMPLES: its one-time costs).
            (t0, x0, _), (t1, x1, _) = self.samples[1], self.samples[-1]
            if x1 <= x0 or t1 <= t0:
                return self.engine_eta_s
            return (total - x) * (t1 - t0) / (x1 - x0)
        model = self.cost_model()
        if model is None:
            return self.engine_eta_s
        return span_cost_s(*model, x, total)

