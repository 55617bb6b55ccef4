"""One engine step's data, typed: the StepPlan the scheduler makes, the StepResult the executor returns, the
TokenOutputs the scheduler's update gives the engine. Torch-free: the contract both sides import.

    plan = scheduler.schedule()          # engine.core.scheduler: a StepPlan
    result = executor.execute(plan)      # engine.exec.plan_executor: a StepResult (it never sees the scheduler)
    outputs = scheduler.update(plan, result)   # TokenOutputs: tokens kept, requests finished

The plan names requests as `StepRequest`, the fields of engine.core.request.Request the executor reads; it
also says what the scheduler holds after planning (which slots are taken, how many decode, whether prompt work
is left), so the executor can choose its path (a step launched ahead, the side stream) from the plan alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.api import FinishReason, SamplingParams

# Finish reasons after which a request's planned work may not have run (engine.core.scheduler discards its
# unfilled prefix blocks).
WORK_LOST_REASONS = ("abort", "error")

ChunkTime = tuple[int, int, float]  # a prompt chunk as it ran: (start, num_tokens, seconds)


@dataclass(frozen=True)
class BlockRef:
    """One cached block: `index` is its position in the prompt (tokens [index*block_tokens, +block_tokens)),
    `block_id` the tier block holding its KV, `digest` its hash-chain key."""

    index: int
    block_id: int
    digest: bytes


class StepRequest(Protocol):
    """What the executor reads of a request (engine.core.request.Request); it never changes one."""

    request_id: str
    slot: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    finish_reason: FinishReason | None
    arrival_s: float  # when it was queued: KV by use decodes the oldest first when not every slot fits the pool

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def is_finished(self) -> bool: ...


# --- the plan ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Admission:
    """A request that got a slot this step. The executor maps (or copies) `cached_blocks` (tier -> slot positions
    [0, cached_tokens)) before running the request's first chunk."""

    request: StepRequest
    slot: int
    cached_tokens: int
    cached_blocks: list[BlockRef]

    @property
    def reuse(self) -> Literal["fresh", "reused"]:
        return "reused" if self.cached_tokens else "fresh"


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, end) of `request` to run in `slot` this step. On the last chunk the executor samples
    the first output token from the logits of position end - 1. `beside_decode`: the chunk runs on the side
    stream while slots decode (engine.exec.chunk_stream) and lands at a later step (`StepResult.landed`)."""

    request: StepRequest
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
    """Full prompt blocks that became computed with this step's chunk: after the forward, the executor puts slot
    positions [ref.index * block_tokens, +block_tokens) into tier block `ref.block_id` for each ref (the ids it
    could not fill go back in `StepResult.unfilled_block_ids`)."""

    request: StepRequest
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
    """Everything one step runs. `decode` lists the requests that decode one token (or verify drafts).

    The scheduler's state once the plan is made, which the executor chooses its path by: `running_slots` (the
    slots holding a request), `num_decoding` (requests decoding from the next step, this plan's last chunks
    included), `prompt_work` (a request waits for a slot or has chunks left to plan), `prompt_work_next` (the
    next plan may admit or prefill), `chunk_in_flight` (a chunk beside the steps has not landed)."""

    admitted: list[Admission] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[StepRequest] = field(default_factory=list)
    cache_fill: list[CacheFill] = field(default_factory=list)
    draft_tokens: int = 0
    running_slots: list[int] = field(default_factory=list)
    num_decoding: int = 0
    prompt_work: bool = False
    prompt_work_next: bool = False
    chunk_in_flight: bool = False

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


# --- the result ----------------------------------------------------------------------------------------------

@dataclass
class SampledTokens:
    """One request's part of an executed step, in the order the step ran it: a prefill chunk that ran
    (`prefilled_tokens`, at `ran_s`), the tokens sampled or accepted for it (none for a chunk before the last),
    and MTP's verification round (`drafts`: proposed, accepted)."""

    request: StepRequest
    token_ids: list[int]
    ran_s: float
    logprobs: list | None = None
    prefilled_tokens: int = 0
    first_token: bool = False  # sampled from a last prompt chunk: the request decodes from now on
    drafts: tuple[int, int] | None = None


@dataclass(frozen=True)
class RequestFailure:
    """A request whose own part of a step failed (the error event is already published): it alone ends."""

    request: StepRequest
    message: str


@dataclass
class StepResult:
    """What executing a StepPlan produced: the executor never changes a request, `Scheduler.update` does.

    `admitted`: the plan's admissions that went through (the engine reports them). `copied`: admissions whose
    cached blocks are in their slots now (their pins may go). `unfilled_block_ids`: tier blocks a cache fill could
    not write. `draft_tokens`: the drafts a slot verifies from now on, when MTP turned off during the step.
    `landed`: the chunk beside the steps that finished this step (its first token, if the last, is in `tokens`;
    the scheduler plans its cache fill). The timings, for the prefill pacing (`timed` False when the step
    failed): `decode_s` (None when nothing decoded), each chunk run between the steps, the cache fills, whether a
    chunk ran beside the decode, and the chunks beside the steps that landed. `error`: what failed the whole step
    after the parts above had run (the engine ends the requests holding a slot)."""

    tokens: list[SampledTokens] = field(default_factory=list)
    failed: list[RequestFailure] = field(default_factory=list)
    admitted: list[Admission] = field(default_factory=list)
    copied: list[StepRequest] = field(default_factory=list)
    unfilled_block_ids: list[int] = field(default_factory=list)
    draft_tokens: int | None = None
    landed: PrefillChunk | None = None
    timed: bool = False
    decode_s: float | None = None
    chunks_s: list[ChunkTime] = field(default_factory=list)
    fill_s: float = 0.0
    beside_chunk: bool = False
    landed_s: list[ChunkTime] = field(default_factory=list)
    error: BaseException | None = None

    def skips(self, request: StepRequest) -> bool:
        """The request has finished, or failed earlier in this step: the rest of its part does not run."""
        return request.is_finished or any(f.request is request for f in self.failed)


# --- what the scheduler's update gives the engine -------------------------------------------------------------

@dataclass(frozen=True)
class TokenOutput:
    """`Scheduler.update`'s word on one request after a step: the tokens it kept (up to a stop token or
    max_tokens), and the reason it finished (with `slot`, the slot it held) or None."""

    request: StepRequest
    slot: int | None
    token_ids: list[int]
    logprobs: list | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token: bool = False
