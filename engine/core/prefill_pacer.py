"""Prefill pacing: how many prompt tokens a step may prefill so that the decoding slots keep their rate.
Pure Python.

At 176K context one 2048-token chunk costs far more than one decode step (every query attends to the whole
prefix), so a token budget alone lets a long admission stall the decoding slots. The engine reports what each
step took (`StepTiming`); the pacer fits the chunk cost model (engine.core.chunk_cost) to the recent chunks, and
sizes the next chunk so that, while slots decode, the prefill part of a step stays within `prefill_step_share` of
the step: prefill_s <= decode_s * share / (1 - share). At 0.5 prefill takes no
longer than decode, so decode keeps 50 % of its rate; the default 0.45 keeps 55 %, a margin over issue 8's 50 %
target for the step time no timing sees (planning, events, the admission's hashing).

Time is kept as credit. Each step with decoding slots and a prompt to prefill earns that allowance; a chunk
spends its predicted cost, and the measured time corrects the prediction when the step is recorded. When even
the minimum chunk costs more than one step earns (a big model deep into a 176K prompt), steps decode only until
the credit covers it: the prompt still progresses, and decode keeps its share on average. After a step that ran
a chunk, at most one step's allowance carries over (what the granule left unspent), so a stretch where the token
budget bound instead of time never turns into a burst.

When steps must save up anyway, the size saved up for is the one with the lowest predicted cost per token
(within `max_chunk_stall_s`, the longest a single chunk may stall the decoding slots): decode keeps the same share
either way, so the chunk that buys the most prompt per second of credit gives the earliest first token. Deep in
a long prompt on a GPU that is a big chunk (what every chunk pays for the span is spread over more tokens); on a
CPU, where attention's cost per token grows with the chunk, a small one. Every fourth such chunk is half that
size, so the fit keeps seeing two sizes at one depth and can tell the per-key term from attention.

The share is a floor for prefill, not a cap on it when prompts outnumber the decoding slots: a step's share is
`max(prefill_step_share, prefilling / (prefilling + decoding))` (`step_share`), every request holding a slot
getting an equal part of the device's time whether it waits for its first token or decodes. One long prompt
beside six decoding slots keeps the configured share (decode keeps its rate); a burst of 128 short prompts next
to the four that were admitted first is not held to 45 % of each step while 124 requests wait for a first token
(their prefill was paced to a few tokens a step).

A burst of short prompts (the scheduler's word: several prompts whose next chunk is their last) fills each step
to `burst_step_s` in all, decode included, instead; never to less than `prefill_step_share` gives, nor, while
the prompts are at least as many as the decoding slots, to less than half of the step (their equal share, up to
half). On a fast device a decode step takes a few milliseconds, less than one short prompt's chunk, so the share
would cut each prompt into pieces of a few hundred tokens, a prompt every few steps; and with hundreds of prompts
waiting, the equal part of each would stretch a step far past what a decoding slot's stream can wait. Filled to
the bound, a step takes several prompts whole (their chunks are rows of one forward) and the decoding slots still
get a token every `burst_step_s`; where decode alone takes most of that (a big model), a step is at most about
twice a decode step. A long prompt is never a burst: beside decoding slots it keeps to the share.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from engine.core.chunk_cost import ChunkCostModel, ChunkTiming
from engine.errors import ConfigError

DEFAULT_PREFILL_STEP_SHARE = 0.45
DEFAULT_MAX_CHUNK_STALL_S = 0.2  # the longest one saved-up chunk may hold the decoding slots
# the longest a step may take while a burst of short prompts is admitted beside decoding slots: their inter-token
# time, under the 50 ms a chat client's stream reads as smooth, with room for the step's host work and for chunks
# that cost more than the fit predicts
DEFAULT_BURST_STEP_S = 0.03
_EXPLORE_EVERY_CHUNKS = 4
_DECODE_WINDOW_STEPS = 5  # median of the last few decode steps: one graph capture does not move it
# decode steps beside chunks: more than one chunk's worth (a step's time beside a chunk varies with the chunk's
# phase: some steps wait while its blocks hold every SM), averaged, since decode's share is one of total times
_BESIDE_WINDOW_STEPS = 256


@dataclass(frozen=True)
class StepTiming:
    """What one executed StepPlan took, measured by the engine (device-synchronized wall time).

    `decode_s`: the decode (or MTP verify + draft) part for `num_decode_rows` slots, None when none decoded.
    `prefill`: each chunk that ran between the steps. `other_prefill_s`: the rest of the step's prefill work
    (cache fills). `landed`: chunks that ran beside the steps, their device time from start to end (not part of
    the step's time, and not fitted: they shared the device).
    """

    decode_s: float | None
    num_decode_rows: int
    prefill: list[ChunkTiming] = field(default_factory=list)
    other_prefill_s: float = 0.0
    beside_chunk: bool = False  # a chunk was in flight on the side stream while this step decoded
    landed: list[ChunkTiming] = field(default_factory=list)  # chunks beside the steps that landed this step

    @property
    def prefill_s(self) -> float:
        return sum(c.seconds for c in self.prefill) + self.other_prefill_s


class PrefillPacer:
    """Sizes prefill chunks by measured cost while slots decode (see the module docstring).

    The scheduler calls `open_step`, then `take` once per prefilling request, then `close_step`; the engine's
    `StepTiming` arrives through `record_step`. A pacer that has never been given a timing does not pace: the
    scheduler then plans by tokens alone, as it does when no slot decodes.
    """

    def __init__(self, prefill_step_share: float = DEFAULT_PREFILL_STEP_SHARE, granule_tokens: int = 256,
                 min_chunk_tokens: int | None = None, cost_model: ChunkCostModel | None = None,
                 max_chunk_stall_s: float = DEFAULT_MAX_CHUNK_STALL_S,
                 burst_step_s: float = DEFAULT_BURST_STEP_S) -> None:
        if isinstance(prefill_step_share, bool) or not isinstance(prefill_step_share, (int, float)) \
                or not 0 < prefill_step_share <= 1:
            raise ConfigError("prefill_step_share", prefill_step_share, "expected a fraction in (0, 1]")
        if isinstance(max_chunk_stall_s, bool) or not isinstance(max_chunk_stall_s, (int, float)) \
                or not max_chunk_stall_s >= 0:
            raise ConfigError("max_chunk_stall_s", max_chunk_stall_s, "expected seconds >= 0")
        if isinstance(burst_step_s, bool) or not isinstance(burst_step_s, (int, float)) or not burst_step_s >= 0:
            raise ConfigError("burst_step_s", burst_step_s, "expected seconds >= 0")
        _require_whole("granule_tokens", granule_tokens)
        min_chunk_tokens = granule_tokens if min_chunk_tokens is None else min_chunk_tokens
        _require_whole("min_chunk_tokens", min_chunk_tokens)
        self.prefill_step_share = float(prefill_step_share)
        self.granule_tokens = granule_tokens
        self.min_chunk_tokens = min_chunk_tokens
        self.max_chunk_stall_s = float(max_chunk_stall_s)
        self.burst_step_s = float(burst_step_s)
        self.cost = cost_model if cost_model is not None else ChunkCostModel()
        self._saved_chunks = 0  # chunks taken after saving up (every _EXPLORE_EVERY_CHUNKS-th is half size)
        self._decode_s: deque[float] = deque(maxlen=_DECODE_WINDOW_STEPS)
        self._beside_s: deque[float] = deque(maxlen=_BESIDE_WINDOW_STEPS)  # decode steps beside a chunk
        self._armed = False  # the engine has reported a step: measured pacing is possible
        self._share = self.prefill_step_share  # this step's (step_share of the requests planned)
        self._burst = False  # this step admits a burst of short prompts (burst_step_s)
        self.credit_s = 0.0
        self._pacing = False
        self._no_decode_time = False
        self._carry_cap_s = 0.0
        self._planned_s = 0.0
        self._planned_chunks = 0
        self._unsettled_s: float | None = None  # predicted prefill of the last paced step, until recorded

    # --- what the engine measured --------------------------------------------------------------------------

    def record_step(self, timing: StepTiming) -> None:
        """The engine's measurement of the step it just ran (the last plan)."""
        self._armed = True
        if timing.decode_s is not None and timing.decode_s > 0:
            (self._beside_s if timing.beside_chunk else self._decode_s).append(timing.decode_s)
        for chunk in timing.prefill:
            self.cost.record(chunk)
        if self._unsettled_s is not None:
            # The chunk spent its prediction; what it really took settles the difference.
            self.credit_s -= timing.prefill_s - self._unsettled_s
            self._unsettled_s = None

    @property
    def decode_s(self) -> float | None:
        """Recent decode step time (median of the last few), None before any."""
        return statistics.median(self._decode_s) if self._decode_s else None

    def step_share(self, num_decoding: int, num_prefilling: int) -> float:
        """Prefill's share of a step with `num_decoding` slots decoding and `num_prefilling` prompts in slots:
        at least `prefill_step_share`, and each request's equal part when prompts outnumber decoding slots."""
        if num_prefilling <= 0:
            return self.prefill_step_share
        return max(self.prefill_step_share, num_prefilling / (num_prefilling + num_decoding))

    def allowance_s(self, share: float | None = None, burst: bool | None = None) -> float | None:
        """Prefill seconds one decoding step earns at `share` (default: the share of the step being planned), and
        for a `burst` (default: the step being planned's) at least what keeps the step within `burst_step_s`;
        None when unknown or unlimited (share 1)."""
        share = self._share if share is None else share
        burst = self._burst if burst is None else burst
        decode_s = self.decode_s
        if decode_s is None or share >= 1:
            return None
        if burst:  # filled to burst_step_s; at least the configured share, or the prompts' equal one up to half
            floor = max(self.prefill_step_share, min(share, 0.5))
            return max(decode_s * floor / (1 - floor), self.burst_step_s - decode_s)
        return decode_s * share / (1 - share)

    def fits_one_step(self, tokens: int, start: int, num_decoding: int, num_prefilling: int) -> bool | None:
        """A chunk of `tokens` from `start` costs no more than one step's allowance at the share of such a step: it
        can run between the steps without saving up. None while no decode time is known."""
        share = self.step_share(num_decoding, num_prefilling)
        if share >= 1:
            return True
        allowance = self.allowance_s(share, burst=False)
        return None if allowance is None else self.cost.predict_s(tokens, start) <= allowance

    def beside_gap_s(self, chunk_s: float) -> float:
        """After a chunk that ran beside the steps for `chunk_s`: how long the side stream stays idle so that
        decode keeps 1 - prefill_step_share of its rate on average. Beside the chunk decode kept
        kept = alone / beside (alone: the median of the last steps without a chunk; beside: the mean of the steps
        beside chunks, since the steps that wait on a chunk's blocks cost decode their whole time, which a median
        leaves out); over the chunk and a gap g, (kept * chunk_s + g) / (chunk_s + g) must reach the target:
        g = chunk_s * (target - kept) / (1 - target). 0 while either time is unknown."""
        if not self._decode_s or not self._beside_s or self._share >= 1:
            return 0.0
        kept = statistics.median(self._decode_s) / statistics.fmean(self._beside_s)
        target = 1 - self._share
        return max(0.0, chunk_s * (target - kept) / (1 - target))

    # --- planning ------------------------------------------------------------------------------------------

    def open_step(self, num_decoding: int, has_prefill: bool, num_prefilling: int = 1, burst: bool = False) -> bool:
        """Start planning a step; True when its prefill is paced by time (slots decode, a prompt waits).
        `num_prefilling`: prompts in slots with chunks left (the step's share, `step_share`); `burst`: they are a
        burst of short prompts (`burst_step_s`)."""
        self._unsettled_s = None  # a plan that was never recorded (a failed step) settles nothing
        self._planned_s, self._planned_chunks = 0.0, 0
        self._share = self.step_share(num_decoding, num_prefilling if has_prefill else 0)
        self._burst = burst and has_prefill
        self._pacing = self._armed and num_decoding > 0 and has_prefill and self._share < 1
        if not self._pacing:
            self.credit_s = 0.0
            return False
        allowance = self.allowance_s()
        # Decoding before any decode step was measured: nothing to size against, so `take` plans one
        # minimum chunk per step (small, and never a stall of the prompt) until a decode time arrives.
        self.credit_s += allowance if allowance is not None else 0.0
        self._no_decode_time = allowance is None
        self._carry_cap_s = allowance if allowance is not None else 0.0
        return True

    def take(self, start: int, max_tokens: int, remaining_tokens: int) -> int:
        """Tokens of the next chunk from prompt position `start` (0: decode only this step, saving credit).

        `max_tokens` is what the token budget allows (already <= remaining_tokens). The chunk ends on a
        multiple of the granule (or at the prompt's end) and is at least the minimum chunk unless the token
        budget or the prompt is shorter.
        """
        if self._no_decode_time:
            n = 0 if self._planned_chunks else self._aligned_min(start, max_tokens, remaining_tokens)
            return self._spend(n, start)
        if self.cost.predict_s(max_tokens, start) <= self.credit_s:
            return self._spend(max_tokens, start)  # the token budget binds, not time
        smallest = self._aligned_min(start, max_tokens, remaining_tokens)
        if self.cost.predict_s(smallest, start) > self._carry_cap_s:
            # One step earns less than the smallest chunk costs: steps save up in any case, so save up for
            # the chunk that buys the most prompt per second (decode keeps the same share either way).
            target = self._saved_up_target(start, smallest, max_tokens)
            if self.cost.predict_s(target, start) > self.credit_s:
                return self._spend(0, start)
            self._saved_chunks += 1
            return self._spend(target, start)
        best, n = 0, smallest
        while n < max_tokens and self.cost.predict_s(n, start) <= self.credit_s:
            best = n
            n = self._next_size(start, n)
        return self._spend(best, start)

    def close_step(self) -> None:
        """End planning: the prediction waits for `record_step`; after a chunk at most one allowance carries."""
        if not self._pacing:
            return
        if self._planned_chunks:
            self.credit_s = min(self.credit_s, self._carry_cap_s)
            self._unsettled_s = self._planned_s

    # --- internals -----------------------------------------------------------------------------------------

    def _next_size(self, start: int, tokens: int) -> int:
        """The next chunk size up that ends on a granule boundary."""
        return ((start + tokens) // self.granule_tokens + 1) * self.granule_tokens - start

    def _saved_up_target(self, start: int, smallest: int, max_tokens: int) -> int:
        """The granule-aligned size in [smallest, max_tokens] with the lowest predicted cost per token whose
        cost stays within max_chunk_stall_s (the smallest when none does); every fourth time, half of it."""
        best, best_per_token = smallest, self.cost.predict_s(smallest, start) / smallest
        n = smallest
        while n < max_tokens:
            n = min(self._next_size(start, n), max_tokens)
            cost_s = self.cost.predict_s(n, start)
            if cost_s > self.max_chunk_stall_s:
                break  # cost grows with size: no larger chunk fits the stall either
            if cost_s / n < best_per_token:
                best, best_per_token = n, cost_s / n
        if best > smallest and (self._saved_chunks + 1) % _EXPLORE_EVERY_CHUNKS == 0:
            half = (start + best // 2) // self.granule_tokens * self.granule_tokens - start
            best = max(smallest, half)
        return best

    def _aligned_min(self, start: int, max_tokens: int, remaining_tokens: int) -> int:
        """The smallest chunk allowed: to the first granule boundary at least `min_chunk_tokens` on."""
        g = self.granule_tokens
        end = -(-(start + self.min_chunk_tokens) // g) * g
        return min(end - start, max_tokens, remaining_tokens)

    def _spend(self, tokens: int, start: int) -> int:
        if tokens > 0:
            cost_s = self.cost.predict_s(tokens, start)
            self.credit_s -= cost_s
            self._planned_s += cost_s
            self._planned_chunks += 1
        return tokens


def _require_whole(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "expected a whole number >= 1")
