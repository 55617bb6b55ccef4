"""What one scheduler step plans (admissions, prefill chunks, decodes and prefix-cache fills) and what running
it produced. Pure Python.

`engine.core.scheduler` builds a StepPlan; `engine.exec.plan_executor` runs it as docs/SCHEDULING.md describes
and returns its StepResult (defined there: the core and the executor never import each other, each reads the
other's dataclass by its fields); `Scheduler.update` turns that into TokenOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.api import FinishReason
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
