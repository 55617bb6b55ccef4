"""One request's state as the scheduler and the runner see it. Pure Python.

Counters are stored once and everything else is derived (properties), so no two fields can disagree:
`num_cached_tokens` (prompt tokens whose KV came from the prefix cache) and `num_prefilled_tokens` (prompt
tokens the runner was planned to compute) make `num_computed_tokens`, `remaining_prompt_tokens` and the
prefill progress.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.api import FinishReason, SamplingParams
from engine.errors import MaxTokensTooLarge, PromptTooLong, RequestRejected
from engine.core.prefill_eta import PrefillClock
from engine.core.prefix_index import BlockRef


class RequestState(enum.Enum):
    """Where a request is. WAITING: queued, no slot. PREFILL: has a slot, prompt not all computed.
    DECODE: generating. FINISHED: done for any reason (see `finish_reason`)."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(frozen=True)
class AppendResult:
    """What `Request.append_output` kept, and why the request should stop (None: keep going)."""

    kept_token_ids: list[int]
    finish_reason: FinishReason | None


class Request:
    """A prompt, its sampling parameters, and its progress through the engine."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        arrival_s: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.params = params if params is not None else SamplingParams()
        self.state = RequestState.WAITING
        self.slot: int | None = None
        self.num_cached_tokens = 0
        self.num_prefilled_tokens = 0  # planned: counted when the scheduler plans a chunk
        self.num_prefill_ran_tokens = 0  # run: counted once the chunk's forward finished (rates use this)
        self.prefill_clock: PrefillClock | None = None  # the chunks' times since admission (the ETA's fit)
        self.cached_blocks: list[BlockRef] = []  # prefix blocks copied in at admission
        self.blocks_pinned = False  # cached_blocks are pinned in the prefix index until copied
        self.output_token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.draft_proposed: list[int] = []  # [i]: drafts proposed at draft position i
        self.draft_accepted: list[int] = []  # [i]: of those, accepted by verification
        self.arrival_s = arrival_s
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self._stop_ids_for: tuple[tuple[int, ...], frozenset[int]] | None = None  # (eos ids, the ids that stop it)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.state.name}, slot={self.slot}, "
                f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
                f"out={self.num_output_tokens})")

    # --- derived state -----------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens whose KV exists (or is planned this step): cached + prefilled."""
        return self.num_cached_tokens + self.num_prefilled_tokens

    @property
    def remaining_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence length the KV will hold."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        return self.remaining_prompt_tokens == 0

    @property
    def queued_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    def prefill_tok_s(self, now_s: float | None = None) -> float | None:
        """Prompt tokens computed per second since admission (cached ones excluded), up to the first token
        or, while prefilling, `now_s`."""
        end_s = self.first_token_s if self.first_token_s is not None else now_s
        if self.admitted_s is None or end_s is None or end_s <= self.admitted_s or not self.num_prefill_ran_tokens:
            return None
        # Tokens of chunks that have run, not merely been planned: a just-planned first chunk over a few
        # microseconds since admission would otherwise read as millions of tokens per second.
        return self.num_prefill_ran_tokens / (end_s - self.admitted_s)

    def chunk_ran(self, tokens: int, now_s: float | None = None) -> None:
        """Record that a planned prefill chunk of `tokens` finished (at `now_s`, monotonic; default now)."""
        now_s = time.monotonic() if now_s is None else now_s
        if self.prefill_clock is None and self.admitted_s is not None:
            self.prefill_clock = PrefillClock(self.num_cached_tokens, self.admitted_s)
        self.num_prefill_ran_tokens += tokens
        if self.prefill_clock is not None:
            self.prefill_clock.ran(self.num_cached_tokens + self.num_prefill_ran_tokens, now_s)

    def prefill_eta_s(self, now_s: float) -> float | None:
        """Seconds of prefill left: the chunks' cost, growing with position (engine.core.prefill_eta), fitted to
        the chunks that ran; 0 once the prompt is computed, None before the first chunk ran."""
        if self.is_prefill_done:
            return 0.0
        if self.prefill_clock is not None:
            return self.prefill_clock.eta_s(self.num_prompt_tokens, now_s)
        rate_tok_s = self.prefill_tok_s(now_s)
        if not rate_tok_s:
            return None
        return (self.num_prompt_tokens - self.num_cached_tokens - self.num_prefill_ran_tokens) / rate_tok_s

    def decode_tok_s(self, now_s: float | None = None) -> float | None:
        """Tokens generated per second after the first one, up to `now_s` (or the finish)."""
        end_s = self.finished_s if self.finished_s is not None else now_s
        if self.first_token_s is None or end_s is None or end_s <= self.first_token_s:
            return None
        return (self.num_output_tokens - 1) / (end_s - self.first_token_s)

    @property
    def acceptance(self) -> float | None:
        """Accepted / proposed MTP drafts over all positions; None before any draft."""
        proposed = sum(self.draft_proposed)
        return sum(self.draft_accepted) / proposed if proposed else None

    def acceptance_at(self, position: int) -> float | None:
        """Acceptance rate of draft position `position` (0 = the first draft after the sampled token)."""
        if position >= len(self.draft_proposed) or self.draft_proposed[position] == 0:
            return None
        return self.draft_accepted[position] / self.draft_proposed[position]

    # --- admission checks ---------------------------------------------------------------------------------

    def check_servable(self, context_tokens: int, vocab_size: int | None = None) -> None:
        """Raise RequestRejected (PromptTooLong, MaxTokensTooLarge) naming the numbers when this request
        cannot fit a `context_tokens` context, or has token ids outside 0..vocab_size-1."""
        prompt_tokens = self.num_prompt_tokens
        if prompt_tokens == 0:
            raise RequestRejected("prompt is empty: at least one token is required", param="prompt")
        if prompt_tokens > context_tokens:
            raise PromptTooLong(prompt_tokens, context_tokens)
        upper = vocab_size if vocab_size is not None else 2**32
        try:
            array("q", self.prompt_token_ids)  # a C-speed check that every id is a whole number
        except (TypeError, OverflowError):
            position, bad = next((i, t) for i, t in enumerate(self.prompt_token_ids)
                                 if not isinstance(t, int) or abs(t) >= 2**63)
            raise RequestRejected(f"prompt token {position} is {bad!r}: token ids are whole numbers",
                                  param="prompt") from None
        if min(self.prompt_token_ids) < 0 or max(self.prompt_token_ids) >= upper:
            position, bad = next((i, t) for i, t in enumerate(self.prompt_token_ids) if not 0 <= t < upper)
            raise RequestRejected(f"prompt token {position} is {bad}: token ids must be in 0..{upper - 1}",
                                  param="prompt")
        max_tokens = self.params.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestRejected(f"max_tokens={max_tokens!r}: expected a whole number >= 1", param="max_tokens")
        if prompt_tokens + max_tokens > context_tokens:
            raise MaxTokensTooLarge(max_tokens, prompt_tokens, context_tokens)

    # --- updates (the engine calls these after a step) ---------------------------------------------------

    def append_output(
        self, token_ids: Iterable[int], now_s: float, eos_token_ids: Iterable[int] = ()
    ) -> AppendResult:
        """Append sampled (or accepted draft) tokens, stopping at a stop token or max_tokens.

        A stop token (`params.stop_token_ids`, or EOS unless `ignore_eos`) is kept, and what follows it is
        dropped; so is anything past `max_tokens`. The request is not finished here: the engine calls
        `Scheduler.finish(req, result.finish_reason)` when the reason is not None.
        """
        if self.is_finished:
            raise ValueError(f"request {self.request_id!r} is finished ({self.finish_reason}); cannot append")
        stops = self._stop_ids(tuple(eos_token_ids))
        out = self.output_token_ids
        room = self.params.max_tokens - len(out)
        kept: list[int] = []
        reason: FinishReason | None = None
        # runs per decoding row per step: the stop set is built once per request, the room counted down
        for token_id in token_ids:
            if room <= 0:
                reason = "length"
                break
            out.append(token_id)
            kept.append(token_id)
            room -= 1
            if token_id in stops:
                reason = "stop"
                break
        if reason is None and room <= 0:
            reason = "length"
        if kept and self.first_token_s is None:
            self.first_token_s = now_s
        return AppendResult(kept, reason)

    def _stop_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The token ids that end this request (its stop_token_ids, and EOS unless ignore_eos), built once."""
        cached = self._stop_ids_for
        if cached is None or cached[0] != eos_token_ids:
            stops = set(self.params.stop_token_ids)
            if not self.params.ignore_eos:
                stops.update(eos_token_ids)
            cached = self._stop_ids_for = (eos_token_ids, frozenset(stops))
        return cached[1]

    def record_drafts(self, proposed: int, accepted: int) -> None:
        """Count one verification round: `proposed` drafts at positions 0..proposed-1, the first `accepted`
        of them accepted (acceptance is a prefix: a rejected draft ends the round)."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted={accepted}, proposed={proposed}: expected 0 <= accepted <= proposed")
        while len(self.draft_proposed) < proposed:
            self.draft_proposed.append(0)
            self.draft_accepted.append(0)
        for position in range(proposed):
            self.draft_proposed[position] += 1
            if position < accepted:
                self.draft_accepted[position] += 1
