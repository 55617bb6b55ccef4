"""Slots, admission and chunked-prefill planning. Pure Python: moves Request objects, counts tokens and blocks.

Every `schedule()` returns one StepPlan, the whole of what the runner does in that step:

1. The previous step ends (`end_step`, if the engine has not called it): the pins that kept the blocks
   it copied from and filled in the tier are released.
2. Free slots take waiting requests in FIFO order; each admission looks up the longest cached prefix of its
   prompt (never the last token, whose logits must be computed) and pins those blocks.
3. Every decoding slot decodes, costing `1 + draft_tokens` tokens of the step budget.
4. What is left of `step_token_budget` goes to prefill chunks (at most `prefill_chunk_tokens` each, one per
   request) in admission order. So a 176K-token admission advances a chunk at a time between the decode
   steps of the running slots instead of stalling them.
5. While slots decode, chunks are also sized by measured cost (`engine.core.prefill_pacer`): the engine reports
   each step's timings (`record_step`), and the prefill part of a step is kept within `prefill_step_share` of
   it, because at 176K context a chunk's attention over the prefix costs far more than its token count says.
   Or, where the engine runs chunks beside the steps (`overlap_chunks`, engine.exec.chunk_stream), a chunk
   too dear for one step's allowance runs whole beside the steps, one in flight at a time, and the pacer's gap
   between two keeps decode's share; chunks that fit run between the steps as above.

The plan is a commitment: `schedule()` advances each request's prefill cursor as it plans the chunk, and a
request whose last prompt chunk is planned decodes from the next step on. If a step fails, the engine ends
the requests in it with `finish(req, "error")`.

The queue and the slots are the Scheduler's base (engine.core.slot_queue); the prefix tier's blocks each request
holds, its digest chain and its pins, are a PrefixPins of its own (engine.core.prefix_pins).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from engine.api import FinishReason
from engine.errors import ConfigError, RequestRejected
from engine.core.chunk_cost import ChunkTiming
from engine.core.prefill_pacer import DEFAULT_MAX_CHUNK_STALL_S, DEFAULT_PREFILL_STEP_SHARE, PrefillPacer, StepTiming
from engine.core.prefix_index import PrefixIndex
from engine.core.prefix_pins import PrefixPins
from engine.core.request import Request, RequestState
from engine.core.slot_queue import SlotQueue
from engine.step import (WORK_LOST_REASONS, Admission, BlockRef, CacheFill, PrefillChunk, StepPlan, StepResult,
                         TokenOutput)

__all__ = ["Admission", "CacheFill", "PrefillChunk", "Scheduler", "StepPlan", "StepTiming", "TokenOutput"]

DEFAULT_BLOCK_TOKENS = 256


class Scheduler(SlotQueue):
    """Slots behind a bounded FIFO queue, with continuous batching and chunked prefill."""

    def __init__(
        self,
        num_slots: int,
        queue_max: int,
        prefill_chunk_tokens: int,
        step_token_budget: int,
        prefix_index: PrefixIndex | None = None,
        block_tokens: int | None = None,
        *,
        context_tokens: int,
        draft_tokens: int = 0,
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_step_share: float = DEFAULT_PREFILL_STEP_SHARE,
        chunk_granule_tokens: int | None = None,
        min_chunk_tokens: int | None = None,
        max_chunk_stall_s: float = DEFAULT_MAX_CHUNK_STALL_S,
        eos_token_ids: tuple[int, ...] = (),
        overlap_chunks: bool = False,
        admission_gate: Callable[..., str | None] | None = None,
    ) -> None:
        """`prefill_step_share` (default 0.45): the most of a step's time prefill may take while slots decode
        (0.45: decode keeps >= 55 % of its rate, a margin over the 50 % target; 1: no time limit). Paced chunks end on multiples of
        `chunk_granule_tokens` (default: block_tokens) and are at least `min_chunk_tokens` (default: one granule).
        `max_chunk_stall_s` (default 0.2): the longest a chunk that steps saved up for may take (engine.prefill_pacer).
        `overlap_chunks`: the engine runs chunks beside the decoding slots' steps (engine.exec.chunk_stream): one in
        flight at a time, the next after the pacer's gap. `admission_gate`: KV by use (engine.exec.kv.admission):
        why the next request must wait for blocks (None: room), given the first chunks admitted this step, each
        decoding slot's tokens after its next step and (`reach_tokens=`) each request's prompt + max_tokens."""
        for name, value in (("num_slots", num_slots), ("queue_max", queue_max),
                            ("prefill_chunk_tokens", prefill_chunk_tokens),
                            ("step_token_budget", step_token_budget), ("context_tokens", context_tokens)):
            _require_positive(name, value)
        if prefill_chunk_tokens > step_token_budget:
            raise ConfigError("prefill_chunk_tokens", prefill_chunk_tokens,
                              f"must not exceed step_token_budget ({step_token_budget})")
        if prefix_index is not None:
            if block_tokens is not None and block_tokens != prefix_index.block_tokens:
                raise ConfigError("block_tokens", block_tokens,
                                  f"differs from the prefix index's block_tokens ({prefix_index.block_tokens})")
            block_tokens = prefix_index.block_tokens
        self.block_tokens = block_tokens if block_tokens is not None else DEFAULT_BLOCK_TOKENS
        _require_positive("block_tokens", self.block_tokens)
        super().__init__(num_slots, queue_max)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.step_token_budget = step_token_budget
        self.context_tokens = context_tokens
        if vocab_size is not None:
            _require_positive("vocab_size", vocab_size)
        self.vocab_size = vocab_size
        self.prefix_index = prefix_index
        self._clock = clock
        self.eos_token_ids = tuple(eos_token_ids)  # the model's stop tokens: `update` ends a request at one
        granule = chunk_granule_tokens if chunk_granule_tokens is not None else self.block_tokens
        self.pacer = PrefillPacer(prefill_step_share, granule, min_chunk_tokens, max_chunk_stall_s=max_chunk_stall_s)
        self._draft_tokens = 0
        self.set_draft_tokens(draft_tokens)
        self._prefilling: list[Request] = []  # admission order: the FIFO order of prefill chunks
        self.overlap_chunks = overlap_chunks
        self.admission_gate = admission_gate
        self.admission_wait = ""  # why the head of the queue waits while a slot is free ("" when it does not)
        self._in_flight: Request | None = None
        self._next_launch_s = 0.0
        self._pins = PrefixPins(prefix_index) if prefix_index is not None else None

    @classmethod
    def from_config(cls, config: Any, prefix_index: PrefixIndex | None = None, step_token_budget: int | None = None,
                    **kwargs: Any) -> "Scheduler":
        """Build from an EngineConfig: batch, queue_max, prefill_chunk_tokens, step_token_budget (the one given
        where the config leaves it to the device: engine.core.step_budget), context."""
        budget = config.step_token_budget if config.step_token_budget is not None else step_token_budget
        if budget is None:
            raise ConfigError("step_token_budget", None, "the config leaves it to the device: pass the budget "
                                                          "engine.core.step_budget gives")
        return cls(config.batch, config.queue_max, config.prefill_chunk_tokens, budget,
                   prefix_index, context_tokens=config.context, **kwargs)

    # --- queries -----------------------------------------------------------------------------------------

    @property
    def draft_tokens(self) -> int:
        return self._draft_tokens

    # --- commands ----------------------------------------------------------------------------------------

    def validate(self, req: Request) -> None:
        """Raise RequestRejected (PromptTooLong, MaxTokensTooLarge) when `req` could never be served here."""
        req.check_servable(self.context_tokens, self.vocab_size)
        if req.request_id in self._requests:
            raise RequestRejected(f"request_id={req.request_id!r} is already queued or running",
                                  param="request_id")

    def add(self, req: Request) -> None:
        """Queue a request. Raises RequestRejected for one that can never be served, QueueFull when full."""
        self.validate(req)
        if req.state is not RequestState.WAITING:
            raise RequestRejected(f"request {req.request_id!r} is {req.state.value}, not new", param="request_id")
        self._enqueue(req)

    def set_draft_tokens(self, draft_tokens: int) -> None:
        """Drafts each decoding slot verifies per step (0 when MTP is off or degraded)."""
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 0:
            raise ConfigError("draft_tokens", draft_tokens, "expected a whole number >= 0")
        self._draft_tokens = draft_tokens

    def schedule(self) -> StepPlan:
        """Plan one step: end the last one (`end_step`), admit, decode every decoding slot, then prefill."""
        self.end_step()
        plan = StepPlan(draft_tokens=self._draft_tokens)
        self._admit_waiting(plan)
        plan.decode = [req for req in self._slots if req is not None and req.state is RequestState.DECODE]
        budget_tokens = self.step_token_budget - plan.num_decode_tokens
        if self.overlap_chunks and (plan.decode or self._in_flight is not None) and self._goes_beside(plan):
            self._plan_beside(plan)
            return self._state_after(plan)
        paced = self.pacer.open_step(len(plan.decode), bool(self._prefilling), len(self._prefilling), self._burst())
        for req in list(self._prefilling):
            if budget_tokens <= 0:
                break
            tokens = min(self.prefill_chunk_tokens, req.remaining_prompt_tokens, budget_tokens)
            if paced:
                tokens = self.pacer.take(req.num_computed_tokens, tokens, req.remaining_prompt_tokens)
                if tokens == 0:
                    break  # decode only this step: the chunk's cost is being saved up for
            chunk = self._plan_chunk(req, tokens)
            plan.prefill.append(chunk)
            budget_tokens -= chunk.num_tokens
            fill = self._plan_cache_fill(req, chunk)
            if fill is not None:
                plan.cache_fill.append(fill)
        self.pacer.close_step()
        return self._state_after(plan)

    def _state_after(self, plan: StepPlan) -> StepPlan:
        """The plan, with what this scheduler holds once it is made (the executor chooses its path by it)."""
        plan.running_slots = [req.slot for req in self._slots if req is not None]
        plan.num_decoding = self.num_decoding
        plan.prompt_work = self.has_prompt_work
        plan.prompt_work_next = self.prompt_work_next
        plan.chunk_in_flight = self.chunk_in_flight
        return plan

    def _goes_beside(self, plan: StepPlan) -> bool:
        """Chunks run beside the steps while one is in flight (one at a time: the two streams share the chunks'
        graph pool and split counters) and when a lone prompt's next chunk would not fit one step's prefill allowance
        between the steps (a long prompt deep into its context: what the side stream is for). A burst of short
        prompts always runs between the steps, paced: beside them it would get one chunk of one request per launch,
        land and gap (on a GPU many steps per prompt), and a forward measured slow once (a first launch, the
        allocator taking memory back from the tier) would price every chunk of it out of a step's allowance."""
        if self._in_flight is not None or not self._prefilling:
            return True
        if self._burst():
            return False
        req = self._prefilling[0]
        tokens = min(self.prefill_chunk_tokens, req.remaining_prompt_tokens,
                     max(1, self.step_token_budget - plan.num_decode_tokens))
        fits = self.pacer.fits_one_step(tokens, req.num_computed_tokens, len(plan.decode), len(self._prefilling))
        return fits is not True  # no decode step measured alone yet: beside

    def _burst(self) -> bool:
        """More than one prompt in slots, the first's next chunk its last (a long one keeps its own pace)."""
        return len(self._prefilling) > 1 and self._prefilling[0].remaining_prompt_tokens <= self.prefill_chunk_tokens

    def _plan_beside(self, plan: StepPlan) -> None:
        """Slots decode and chunks run beside them (`overlap_chunks`): the first prefilling request's next chunk,
        whole (it stalls no decoding slot), once no chunk is in flight and the pacer's gap after the last one
        has passed. Its cache fill is planned when it lands."""
        self.pacer.open_step(len(plan.decode), False)  # no time pacing between steps
        self.pacer.close_step()
        if self._in_flight is not None or not self._prefilling or self._clock() < self._next_launch_s:
            return
        req = self._prefilling[0]
        chunk = self._plan_chunk(req, min(self.prefill_chunk_tokens, req.remaining_prompt_tokens), beside=True)
        self._in_flight = req
        plan.prefill.append(chunk)

    def chunk_landed(self, chunk: PrefillChunk, seconds: float) -> CacheFill | None:
        """A chunk that ran beside the steps has finished (in `seconds`, start to end on the device): its request
        decodes from now on if it was the last, the next chunk may be planned after the pacer's gap, and its full
        blocks go to the prefix tier (the CacheFill to run now; its pins go at the next `end_step`)."""
        req = chunk.request
        if self._in_flight is req:
            self._in_flight = None
        if req.is_finished:
            return None
        if chunk.is_last:
            req.state = RequestState.DECODE
        self._next_launch_s = self._clock() + self.pacer.beside_gap_s(seconds)
        return self._plan_cache_fill(req, chunk)

    @property
    def has_prompt_work(self) -> bool:
        """A request waits for a slot or has prompt chunks left to plan."""
        return bool(self._waiting) or bool(self._prefilling)

    @property
    def prompt_work_next(self) -> bool:
        """The next plan may admit or prefill: a prompt has chunks left, or a queued request has a slot free."""
        return bool(self._prefilling) or (bool(self._waiting) and bool(self._free_slots))

    @property
    def chunk_in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def num_decoding(self) -> int:
        return sum(1 for req in self._slots if req is not None and req.state is RequestState.DECODE)

    def record_step(self, timing: StepTiming) -> None:
        """What the last plan took to run (the engine measures it): feeds the prefill pacing."""
        self.pacer.record_step(timing)

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenOutput]:
        """Take what executing `plan` produced (engine.step.StepResult): the
        prefix pins its copies and fills no longer need, each request's chunks, drafts and tokens (a stop token
        or max_tokens finishes it), the requests whose own part failed (finished with "error"), and the step's
        timing. Returns each request's TokenOutput, in step order.
        """
        for req in result.copied:
            self.release_prefix(req)
        if result.unfilled_block_ids and self.prefix_index is not None:
            self.prefix_index.discard(result.unfilled_block_ids)
        if result.draft_tokens is not None:
            self.set_draft_tokens(result.draft_tokens)
        outputs: list[TokenOutput] = []
        failed = {f.request.request_id for f in result.failed}
        for sampled in result.tokens:
            req = sampled.request
            if req.is_finished or req.request_id in failed:
                continue
            if sampled.prefilled_tokens:
                req.chunk_ran(sampled.prefilled_tokens, sampled.ran_s)
            if sampled.drafts is not None:
                req.record_drafts(*sampled.drafts)
            if sampled.token_ids:
                outputs.append(self._append(req, sampled.token_ids, sampled.ran_s, sampled.logprobs,
                                            sampled.first_token))
        for failure in result.failed:
            slot = failure.request.slot
            if self.finish(failure.request, "error"):
                outputs.append(TokenOutput(failure.request, slot, [], finish_reason="error", error=failure.message))
        if result.timed:
            self.record_step(StepTiming(result.decode_s, len(plan.decode), [ChunkTiming(*c) for c in result.chunks_s],
                                        result.fill_s, beside_chunk=result.beside_chunk,
                                        landed=[ChunkTiming(*c) for c in result.landed_s]))
        return outputs

    def _append(self, req: Request, token_ids: list[int], now_s: float, logprobs: list | None,
                first_token: bool) -> TokenOutput:
        appended = req.append_output(token_ids, now_s, self.eos_token_ids)
        kept = logprobs[:len(appended.kept_token_ids)] if logprobs is not None else None
        slot = req.slot
        if appended.finish_reason is not None:
            self.finish(req, appended.finish_reason)
        return TokenOutput(req, slot, appended.kept_token_ids, kept, appended.finish_reason, first_token=first_token)

    def finish(self, req: Request, reason: FinishReason) -> bool:
        """End a request in any state: frees its queue place or slot and its prefix pins.
        Returns False when it had already finished."""
        if req.is_finished:
            return False
        now_s = self._clock()
        self._leave(req, now_s)
        if req in self._prefilling:
            self._prefilling.remove(req)
        if self._in_flight is req:
            self._in_flight = None
        if self._pins is not None:
            self._pins.release(req)
            self._pins.forget(req, work_lost=reason in WORK_LOST_REASONS)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_s = now_s
        return True

    def abort(self, request_id: str) -> Request | None:
        """Abort a queued or running request by id; returns it, or None when no such request is active."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.finish(req, "abort")
        return req

    def release_prefix(self, req: Request) -> None:
        """The runner has copied `req`'s cached blocks into its slot: unpin them now instead of at `end_step`."""
        if self._pins is not None:
            self._pins.release(req)

    def end_step(self) -> None:
        """The runner has run the last plan, its copies and its cache fills: drop the pins that protected
        them. `schedule()` does this first if the engine has not; calling it after each step lets an idle
        engine's tier shrink freely."""
        if self._pins is not None:
            self._pins.end_step()

    # --- internals ---------------------------------------------------------------------------------------

    def _admit_waiting(self, plan: StepPlan) -> None:
        """Queued requests into free slots, in order; with an admission gate, while it finds KV room for them beside
        the running requests (engine.exec.kv.admission; with none running, the next is admitted whatever it says)."""
        first_chunks: list[int] = []
        decoding: dict[int, int] | None = None  # slot -> tokens it holds after its next step
        self.admission_wait = ""
        while self._free_slots and self._waiting:
            req = self._waiting[0]
            if self.admission_gate is not None and self.num_running:
                if decoding is None:
                    decoding = {r.slot: r.num_tokens + self._draft_tokens + 1 for r in self._slots
                                if r is not None and r.state is RequestState.DECODE}
                    final_tokens = [r.num_prompt_tokens + r.params.max_tokens for r in self._slots if r is not None]
                first_chunks.append(min(self.prefill_chunk_tokens, req.num_prompt_tokens))  # this one last in both
                final_tokens.append(req.num_prompt_tokens + req.params.max_tokens)
                why = self.admission_gate(first_chunks, decoding, reach_tokens=final_tokens)
                if why is not None:
                    self.admission_wait = why
                    return
            plan.admitted.append(self._admit(self._waiting.popleft()))

    def _admit(self, req: Request) -> Admission:
        slot = self._take_slot(req)
        blocks: list[BlockRef] = self._pins.admit(req) if self._pins is not None else []
        req.state = RequestState.PREFILL
        req.cached_blocks = blocks
        req.blocks_pinned = bool(blocks)
        req.num_cached_tokens = len(blocks) * self.block_tokens
        req.num_prefilled_tokens = 0
        req.admitted_s = self._clock()
        self._prefilling.append(req)
        return Admission(req, slot, req.num_cached_tokens, blocks)

    def _plan_chunk(self, req: Request, tokens: int, beside: bool = False) -> PrefillChunk:
        assert req.slot is not None
        start = req.num_computed_tokens
        end = start + tokens
        req.num_prefilled_tokens += end - start
        is_last = req.is_prefill_done
        if is_last:
            self._prefilling.remove(req)
            if not beside:  # a chunk beside the steps has no first token yet: it decodes once it lands
                req.state = RequestState.DECODE
        return PrefillChunk(req, req.slot, start, end, is_last, beside_decode=beside)

    def _plan_cache_fill(self, req: Request, chunk: PrefillChunk) -> CacheFill | None:
        return self._pins.plan_fill(req, chunk) if self._pins is not None else None


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "expected a whole number >= 1")
