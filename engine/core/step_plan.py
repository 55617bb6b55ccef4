"""What one scheduler step plans (admissions, prefill chunks, decodes and prefix-cache fills) and what running
it produced. Pure Python.

`engine.core.scheduler` builds a StepPlan; `engine.exec.plan_executor` runs it as docs/SCHEDULING.md describes
and returns a StepResult; `Scheduler.update` turns that into TokenOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.api import FinishReason
from engine.core.prefill_pacer import StepTiming
from engine.core.prefix_index import BlockRef
from engine.core.request import Request

# Finish reasons after which a request's planned work may not have run (see `Scheduler._discard_unfilled`).
WORK_LOST_REASONS = ("abort", "error")


@dataclass(frozen=True)
class Admission:
    """A request that got a slot this step. The runner copies `cached_blocks` (tier -> slot positions
    [0, cached_tokens)) before running the request's first chunk."""

    request: Request
    slot: int
    cached_tokens: int
    cached_blocks: list[BlockRef]

    @property
    def reuse(self) -> Literal["fresh", "reused"]:
        return "reused" if self.cached_tokens else "fresh"


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, end) of `request` to run in `slot` this step. On the last chunk the runner samples
    the first output token from the logits of position end - 1. `beside_decode`: the chunk runs on the side
    stream while slots decode (engine.exec.chunk_stream) and lands at a later step (`Scheduler.chunk_landed`)."""

    request: Request
    slot: int
    start: int
    end: int
    is_last: bool
    beside_decode: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CacheFill:
    """Full prompt blocks that became computed with this step's chunk: after the forward, the runner copies
    slot positions [ref.index * block_tokens, +block_tokens) into tier block `ref.block_id` for each ref
    (or calls `PrefixIndex.discard` on the ids it could not fill)."""

    request: Request
    slot: int
    blocks: list[BlockRef]

    @property
    def should_fill(self) -> bool:
        """False once the request was aborted or failed: its blocks were discarded, skip the copy."""
        return self.request.finish_reason not in WORK_LOST_REASONS

    def later_blocks(self, block_tokens: int) -> int:
        """Full prompt blocks of the request after this fill's, which later steps fill (a pool growth for this
        fill makes room for them at once: engine.exec.kv.tier.AdaptiveTier.fill)."""
        last = max((ref.index for ref in self.blocks), default=-1)
        return max(0, self.request.num_prompt_tokens // block_tokens - 1 - last)


@dataclass
class StepPlan:
    """Everything one step runs. `decode` lists slots that decode one token (or verify drafts)."""

    admitted: list[Admission] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    cache_fill: list[CacheFill] = field(default_factory=list)
    draft_tokens: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefill)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode) * (1 + self.draft_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes: the quantity `step_token_budget` bounds."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode)


@dataclass
class SampledTokens:
    """One request's part of an executed step, in the order the step ran it: a prefill chunk that ran
    (`prefilled_tokens`, at `ran_s`), the tokens sampled or accepted for it (none for a chunk before the last),
    and MTP's verification round (`drafts`: proposed, accepted)."""

    request: Request
    token_ids: list[int]
    ran_s: float
    logprobs: list | None = None
    prefilled_tokens: int = 0
    first_token: bool = False  # sampled from a last prompt chunk: the request decodes from now on
    drafts: tuple[int, int] | None = None


@dataclass(frozen=True)
class RequestFailure:
    """A request whose own part of a step failed (the error event is already published): it alone ends."""

    request: Request
    message: str


@dataclass
class StepResult:
    """What executing a StepPlan produced, for `Scheduler.update`: the executor never changes the requests.

    `copied`: admissions whose cached blocks are in their slots now (their pins may go). `unfilled_block_ids`:
    tier blocks a cache fill could not write. `draft_tokens`: the drafts a slot verifies from now on, when MTP
    turned off during the step. `timing`: for the prefill pacing (None when the step failed). `error`: what
    failed the whole step after the parts above had run (the engine ends the requests holding a slot)."""

    tokens: list[SampledTokens] = field(default_factory=list)
    failed: list[RequestFailure] = field(default_factory=list)
    copied: list[Request] = field(default_factory=list)
    unfilled_block_ids: list[int] = field(default_factory=list)
    draft_tokens: int | None = None
    timing: StepTiming | None = None
    error: BaseException | None = None

    def skips(self, request: Request) -> bool:
        """The request has finished, or failed earlier in this step: the rest of its part does not run."""
        return request.is_finished or any(f.request is request for f in self.failed)


@dataclass(frozen=True)
class TokenOutput:
    """`Scheduler.update`'s word on one request after a step: the tokens it kept (up to a stop token or
    max_tokens), and the reason it finished (with `slot`, the slot it held) or None."""

    request: Request
    slot: int | None
    token_ids: list[int]
    logprobs: list | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token: bool = False
