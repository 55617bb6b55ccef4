"""PlanExecutor: runs one StepPlan on the device and returns what it produced (a StepResult; both in engine.step).

The middle of the engine's step (`schedule` -> `execute` -> `update`): map (or copy) reused prefix blocks into
newly admitted slots, one batched decode of every decoding slot along the path that fits (MTP's fused verify +
draft step, its separate verify + sample + draft round, a plain decode, or the step launched ahead by
engine.exec.decode_ahead), the plan's prefill chunks with their first tokens and MTP's drafter prefill, then the
cache fills. On CUDA, while slots decode, a prompt chunk instead runs beside the steps on a side stream
(engine.exec.chunk_stream): the step that plans it launches it before its decode, and the end of a later step
lands it (its first token and the drafter prefill; `StepResult.landed`, whose cache fill the scheduler plans and
`fill_landed` runs before the slot can change hands) once its kernels are done.

It never sees the scheduler and never changes a request: it reads the plan (which also says what the scheduler
holds: slots taken, requests decoding, prompt work left) and returns the tokens, the chunks that ran and the
drafts in the StepResult, and `Scheduler.update` does the bookkeeping. A failure inside one request's own part
(its admission, a chunk, its sampling) fails that request only (`StepResult.failed`); anything else fails the
step (`StepResult.error`), after the parts that ran.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from engine.api import SamplingParams
from engine.exec import chunk_rows
from engine.exec.chunk_stream import ChunkStream
from engine.exec.cuda_streams import Streams
from engine.exec.decode_ahead import DecodeAhead
from engine.exec.drafter import MtpDrafter
from engine.exec.gpu_errors import error_event, is_sticky, real_message
from engine.exec.kv.admission import rows_that_fit
from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.tier import AdaptiveTier
from engine.exec.prefill_window import PrefillWindow
from engine.exec.runner import ModelRunner, MtpUnavailable, Row, StepOutput
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, pow2_bucket
from engine.exec.step_fns import StepExecutor
from engine.exec.sampler import (NonFiniteLogits, SampleResult, device_result, non_finite_rows, sample_isolating_rows,
                                 sample_with_drafts)
from engine.step import (Admission, CacheFill, ChunkTime, PrefillChunk, RequestFailure, SampledTokens, StepPlan,
                         StepRequest, StepResult)
from engine.telemetry import EventBus, WarningEvent


class PlanExecutor:
    """`execute(plan) -> StepResult`; `fill_landed(fill, result)` for a landed chunk's blocks; `release(request,
    slot)` once a request holding a slot has finished."""

    def __init__(self, *, runner: ModelRunner, drafter: MtpDrafter | None, kv: SlotKVCache, tier: AdaptiveTier,
                 streams: Streams, chunks: ChunkStream | None, ahead: DecodeAhead, graphs: StepExecutor,
                 device: torch.device, bus: EventBus, window: PrefillWindow | None = None,
                 rows_max_tokens: int | None = None) -> None:
        """`graphs`: the step executor the runner replays its graphs through (MTP turned off gives the drafter's
        back). `window`: an MoE model's layer-major prefill windows (engine.exec.prefill_window), or None.
        `rows_max_tokens`: the most tokens, padding included, of one forward of several prompts' chunks
        (the step token budget: padding to a row's length bucket could otherwise double a step's activations)."""
        self.runner, self.drafter = runner, drafter
        self.kv, self.tier, self.chunks, self.ahead, self.graphs = kv, tier, chunks, ahead, graphs
        self.streams = streams  # the steps' stream, and each launch's split-counter lane
        self.window = window
        self.device = device
        self.bus = bus
        self.rows_max_tokens = rows_max_tokens
        self.mtp_on = drafter is not None
        self.mtp_off_reason: str | None = None
        self.generators: dict[str, torch.Generator] = {}  # per request: its seeded sampling draws
        depth = runner.mtp_depth if self.mtp_on else 0
        self.draft_proposed = [0] * depth  # per draft position, since start (the metrics' counters)
        self.draft_accepted = [0] * depth
        self._ahead_slots: frozenset[int] = frozenset()  # the slots of the decode group that may have gone ahead
        self._result = StepResult()
        self._non_finite_ended = False  # a request ended on NaN logits: the next step scrubs the pool first

    # --- the step ------------------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run `plan`; a failure of the whole step comes back as `StepResult.error`, after the parts that ran."""
        result = self._result = StepResult()
        if self.kv.paging is not None:
            self.kv.paging.stats.paused_requests = 0  # `_decode` counts this step's
        try:
            on_steps = self.streams.on("steps") if self._may_overlap(plan) else contextlib.nullcontext()
            with torch.inference_mode(), on_steps:
                self.kv.reclaim_retired()  # finished requests' pool and host blocks (--kv-resident)
                self.tier.reclaim_retired()  # finished requests' mapped tier blocks (a shared tier)
                if self._non_finite_ended:  # a request ended on NaN logits (its slot is reclaimed now): its blocks
                    self._non_finite_ended = False  # must reach no other request, this step's admissions included
                    admitted = {admission.slot for admission in plan.admitted}
                    self.tier.scrub_non_finite(slot for slot in plan.running_slots if slot not in admitted)
                for admission in plan.admitted:
                    self._isolated(admission.request, self._admit, admission)
                self._run_timed(plan)
                self._land_chunk(plan)  # last: its request decodes from the next step on
                self.tier.reclaim_retired()  # the step's fills are done: what finished maps nothing now
            result.timed = True
        except Exception as exc:  # noqa: BLE001 - the engine decides how bad (Engine._fail)
            result.error = exc
        return result

    def fill_landed(self, fill: CacheFill | None, result: StepResult) -> None:
        """The cache fill of `result.landed` (the scheduler planned it when it heard of the landing), before the
        slot can change hands; a failure fails the step (`result.error`), like any fill inside `execute`. Nothing
        after a step that failed: its requests holding a slot end, and their unfilled blocks are discarded."""
        if fill is None or result.error is not None:
            return
        try:
            with torch.inference_mode(), self.streams.on("steps"):  # where the chunk was taken, like any fill
                result.unfilled_block_ids.extend(self._fill([fill]))
                self.tier.reclaim_retired()
        except Exception as exc:  # noqa: BLE001 - the engine decides how bad (Engine._fail)
            result.error = result.error or exc

    def release(self, request: StepRequest, slot: int | None, wait: bool = True) -> None:
        """A request has finished: forget its generator; a chunk of it in flight ends (`wait`: for its kernels),
        a step launched ahead over its slot is dropped, and its slot's blocks go back at the next step."""
        self.generators.pop(request.request_id, None)
        if self.window is not None:
            self.window.drop(request.request_id)
        if self.chunks is not None and self.chunks.holds(request):
            self.chunks.drop(wait=wait)  # its chunk writes the slot's blocks until it ends
        if slot is None:
            return
        if self.ahead.pending and slot in self._ahead_slots:
            self.ahead.drop()  # its slot's blocks go back at the next step: the step in flight writes them
        self.kv.retire_slot(slot)
        self.tier.retire_slot(slot)

    def _run_timed(self, plan: StepPlan) -> None:
        """Decode, prefill and fill the plan, timing each part for the scheduler's prefill pacing.

        Each part ends on a device sync: a chunk's kernels would otherwise still be running when the next
        part's clock starts, and its cost would be billed to decode. A decode ends on one already (sampling
        copies its tokens to the host), and a step leaves the device idle, so a plain decode step pays for no
        extra sync (each costs tens of microseconds of host time on a step of about a millisecond).
        """
        decode_s = None
        if self.window is not None:  # while slots decode, a prompt's windows ramp up and run in slices
            self.window.decoding = bool(plan.decode)
        t0_s = self._synced_clock() if plan.admitted else time.perf_counter()  # admissions queue KV copies
        for chunk in plan.prefill:  # a chunk beside the steps first: the side stream starts on it at once
            if chunk.beside_decode and not self._result.skips(chunk.request):
                self._isolated(chunk.request, self.chunks.launch, chunk, lambda c=chunk: self._forward(c))
        beside = self.chunks is not None and self.chunks.in_flight is not None
        if plan.decode:
            t0_s = self._synced_clock() if beside else t0_s  # the launch's host time is not decode's
            self._decode(plan.decode, plan)
            # MTP's draft round runs after the sampling sync: drain it when a chunk's clock starts next.
            decode_s = (self._synced_clock() if plan.prefill and not beside else time.perf_counter()) - t0_s
            # a step taken ahead: its device time (the host only waited for its last part)
            decode_s = self.ahead.step_period_s() or decode_s
        chunks: list[ChunkTime] = []
        waiting = [chunk for chunk in plan.prefill  # not failed or aborted, nor launched above
                   if not (self._result.skips(chunk.request) or chunk.beside_decode)]
        # a chunk a prefill window serves runs alone: the window, not a shared forward, holds its hidden states
        windowed = [c for c in waiting if self.window is not None and self.window.applies(c)]
        rows = [c for c in waiting if all(c is not w for w in windowed)]
        groups = [[c] for c in windowed] + (chunk_rows.chunk_groups(rows, self._bucket, self.rows_max_tokens)
                                            if chunk_rows.batches_chunks(self.runner) else [[c] for c in rows])
        for group in groups:
            t0_s = self._synced_clock()
            if len(group) == 1:
                self._isolated(group[0].request, self._prefill, group[0])
            else:
                self._prefill_group(group)
            seconds = self._synced_clock() - t0_s
            tokens = sum(chunk.num_tokens for chunk in group)
            # the group's time shared by tokens: the pacer's cost fit reads each chunk's (start, tokens, seconds)
            chunks += [(chunk.start, chunk.num_tokens, seconds * chunk.num_tokens / tokens) for chunk in group]
        fill_s = 0.0
        if plan.cache_fill:
            t0_s = self._synced_clock()
            self._result.unfilled_block_ids.extend(self._fill(plan.cache_fill))
            fill_s = self._synced_clock() - t0_s
        self._result.decode_s, self._result.chunks_s, self._result.fill_s = decode_s, chunks, fill_s
        self._result.beside_chunk = beside

    def _fill(self, fills: list[CacheFill]) -> list[int]:
        """Run the cache fills; returns the tier block ids that could not be filled."""
        unfilled: list[int] = []
        for fill in fills:
            if fill.should_fill:  # its request was aborted or failed: the scheduler discarded its blocks
                unfilled += self.tier.fill(fill.blocks, fill.slot, fill.later_blocks(self.tier.block_tokens))
        return unfilled

    def _may_overlap(self, plan: StepPlan) -> bool:
        """A chunk is in flight or may be launched this step: the step runs on the steps' stream (otherwise on
        the caller's, which saves a plain decode step two stream waits; the streams are ordered either way)."""
        return self.chunks is not None and (self.chunks.in_flight is not None or plan.prompt_work
                                            or any(chunk.beside_decode for chunk in plan.prefill))

    def _synced_clock(self) -> float:
        """perf_counter after the device has finished the work queued so far (on the steps' stream only, where
        chunks may run beside the steps: a chunk in flight keeps running)."""
        if self.chunks is not None:
            self.chunks.sync()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _land_chunk(self, plan: StepPlan) -> None:
        """The chunk beside the steps, once its kernels are done (waited for when no slot decodes: nothing else
        would run): its first token and its drafter prefill; `result.landed` and its timing (StepTiming.landed)."""
        if self.chunks is None or self.chunks.in_flight is None:
            return
        if not self.chunks.ready() and plan.num_decoding:
            return
        flight = self.chunks.take()
        chunk = flight.chunk
        self._result.landed = chunk
        self._result.landed_s = [(chunk.start, chunk.num_tokens, flight.seconds)]
        if not self._result.skips(chunk.request):
            self._isolated(chunk.request, self._chunk_ran, chunk, flight.out)

    def _admit(self, admission: Admission) -> None:
        if admission.cached_blocks:
            self.tier.load(admission.cached_blocks, admission.slot)
            self._result.copied.append(admission.request)
        self._result.admitted.append(admission)

    def _decode(self, reqs: list[StepRequest], plan: StepPlan) -> None:
        """Decode (or verify) every decoding slot whose KV fits the pool beside the others' (KV by use without a
        resident window: `rows_that_fit`, the rest pause this step): one batched forward per group of similar
        lengths."""
        extra = self.runner.mtp_depth + 1 if self.mtp_on else 1
        paging = self.kv.paging
        picked = paging is not None and not paging.layout.resident_blocks
        if picked:
            ahead = self.runner.lookahead_tokens
            flying = [self.chunks.in_flight.chunk] if self.chunks is not None and self.chunks.in_flight else []
            kept = rows_that_fit(paging, [(r.slot, r.num_tokens - 1 + extra + ahead, r.arrival_s) for r in reqs],
                                 [(chunk.slot, chunk.end + ahead) for chunk in plan.prefill + flying])
            paging.stats.paused_requests = len(reqs) - len(kept)
            reqs = [reqs[i] for i in kept]
        for group in self.runner.span_groups([req.num_tokens - 1 + extra for req in reqs], fit_pool=not picked):
            self._decode_group([reqs[i] for i in group], plan)

    def _decode_group(self, reqs: list[StepRequest], plan: StepPlan) -> None:
        rows = [Row(req.slot, req.output_token_ids[-1], req.num_tokens - 1) for req in reqs]
        params = [req.params for req in reqs]
        gens = [self.generators[req.request_id] for req in reqs]
        histories = [(req.prompt_token_ids, req.output_token_ids) for req in reqs]
        result = None
        failed: dict[int, BaseException] = {}
        drafts: list[int] | None = None
        self._ahead_slots = frozenset(req.slot for req in reqs)
        # The fused step samples on the device with temperature and top_p only: anything more takes the
        # separate verify + sample + round path (same tokens, two graph kinds instead of one).
        on_device = not any(p.penalized or p.top_k or p.min_p or p.logprobs is not None for p in params)
        if self.mtp_on:
            try:
                if self.drafter.fused and on_device:
                    step = self.ahead.take(rows, "verify")
                    if step is None:
                        step = self.drafter.verify_and_draft(rows, params, gens)
                    if self._goes_ahead(reqs, params, plan) and self.ahead.next_verify_fits(rows, step):
                        result = self.ahead.read_and_launch_verify(rows, step)
                    else:
                        result = device_result(step.emitted, len(rows))
                    failed = non_finite_rows(result)  # the step's finite check, read with its tokens
                    drafts = self._record_drafts(result.accepted)
                else:
                    out = self.runner.verify(rows)
                    result, failed = sample_isolating_rows(out.logits, out.drafts, params, gens, histories, is_sticky)
                    drafts = self._record_drafts(result.accepted)
                    pending = [Row(r.slot, toks[-1], r.position + len(toks)) for r, toks in zip(rows, result.tokens)]
                    self.drafter.round(pending, out.hidden, result.tokens, [r.position for r in rows])
            except MtpUnavailable as exc:  # a verify that failed emitted nothing: result None, plain decode
                self._mtp_off(exc)
        if result is None:
            out = self.ahead.take(rows)
            out = self.runner.decode(rows) if out is None else out
            if self._goes_ahead(reqs, params, plan) and self.ahead.next_rows_fit(rows, out):
                result = SampleResult([0] * len(rows), self.ahead.read_and_launch(rows, out))
                failed = non_finite_rows(result)  # the step's finite check, read with its tokens
            else:
                result, failed = sample_isolating_rows(out.logits, None, params, gens, histories, is_sticky, out.best)
        now_s = time.monotonic()
        logprobs = result.logprobs or [None] * len(reqs)
        for i, (req, tokens) in enumerate(zip(reqs, result.tokens)):
            if i in failed:
                self._fail_request(req, failed[i])
            else:
                self._result.tokens.append(SampledTokens(req, tokens, now_s, logprobs[i], drafts=(
                    (self.runner.mtp_depth, drafts[i]) if drafts is not None else None)))

    def _goes_ahead(self, reqs: list[StepRequest], params: list[SamplingParams], plan: StepPlan) -> bool:
        """The next step may be launched before this one's tokens are read (engine.exec.decode_ahead): every
        decoding slot is in this group, all greedy, each has room for another step (MTP's: K + 1 tokens more
        than this one may emit), and no prompt chunk will run between the steps (chunks beside the steps run on
        their own stream: a chunk that lands, making its request decode, drops the step launched ahead)."""
        quiet = self.chunks is not None or not (plan.prompt_work_next or plan.chunk_in_flight)
        room = 2 * (self.runner.mtp_depth + 1) if self.mtp_on else 1
        return (self.ahead.enabled and len(reqs) == plan.num_decoding and quiet
                and all(p.temperature <= 0 and not p.penalized and p.logprobs is None for p in params)
                and all(req.num_output_tokens + room < req.max_tokens for req in reqs))

    def _record_drafts(self, accepted: list[int]) -> list[int]:
        """Count each row's accepted drafts in the engine's per-position counters; the requests' own counts go
        back with their tokens."""
        depth = self.runner.mtp_depth
        for n in accepted:
            for position in range(depth):
                self.draft_proposed[position] += 1
                self.draft_accepted[position] += position < n
        return list(accepted)

    def _prefill(self, chunk: PrefillChunk) -> None:
        with self.streams.on("chunks"):  # between the steps: the current stream and the steps' lane
            out = self._forward(chunk)
        self._chunk_ran(chunk, out)

    def _bucket(self, tokens: int) -> int:
        return pow2_bucket(tokens, MIN_CHUNK_TOKENS)

    def _prefill_group(self, group: list[PrefillChunk]) -> None:
        """Chunks of one length bucket as rows of one forward (engine.exec.chunk_rows); each row's first token
        and drafter prefill as a lone chunk's. A forward that fails runs each chunk alone, so a fault fails only
        the request it belongs to."""
        try:
            with self.streams.on("chunks"):
                out = chunk_rows.prefill_rows(self.runner, [(c.slot, c.request.prompt_token_ids[c.start:c.end],
                                                             c.start) for c in group])
        except MtpUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - whose it is, is found by running each chunk alone
            if is_sticky(exc):
                raise
            for chunk in group:
                self._isolated(chunk.request, self._prefill, chunk)
            return
        for i, chunk in enumerate(group):
            row = StepOutput(out.logits[i:i + 1], out.hidden[i:i + 1], span_tokens=out.span_tokens)
            self._isolated(chunk.request, self._chunk_ran, chunk, row)

    def _forward(self, chunk: PrefillChunk) -> StepOutput:
        """The chunk's forward (StepOutput): on the current stream, or the side stream's (ChunkStream.launch); an
        MoE prompt's chunk whose experts may be cold from its layer-major window (engine.exec.prefill_window)."""
        if self.window is not None and self.window.applies(chunk):
            return self.window.forward(chunk)
        return self.runner.prefill(chunk.slot, chunk.request.prompt_token_ids[chunk.start:chunk.end], chunk.start,
                                   beside=chunk.beside_decode)

    def _chunk_ran(self, chunk: PrefillChunk, out: StepOutput) -> None:
        """After a chunk's forward: the first token of a last chunk, and MTP's drafter prefill."""
        req = chunk.request
        prompt = req.prompt_token_ids
        ran_s = time.monotonic()
        first: int | None = None
        first_logprobs = None
        if chunk.is_last:
            generator = self.generators[req.request_id]
            sampled = sample_with_drafts(out.logits, None, [req.params], [generator],
                                         [(req.prompt_token_ids, req.output_token_ids)])
            first = sampled.tokens[0][0]
            first_logprobs = sampled.logprobs[0] if sampled.logprobs else None
        if self.mtp_on:
            nxt = prompt[chunk.start + 1:chunk.end] + ([first] if first is not None else [prompt[chunk.end]])
            try:
                self.drafter.prefill(chunk.slot, out.hidden, nxt, chunk.start, chunk.is_last)
            except MtpUnavailable as exc:
                self._mtp_off(exc)
        self._result.tokens.append(SampledTokens(req, [first] if first is not None else [], ran_s, first_logprobs,
                                                 prefilled_tokens=chunk.end - chunk.start,
                                                 first_token=first is not None))

    # --- failure paths -------------------------------------------------------------------------------------

    def _isolated(self, req: StepRequest, fn: Callable[..., None], *args: Any) -> None:
        """Run one request's own part of a step (admission, a prefill chunk): a failure there ends that request
        only. A sticky CUDA error still fails the step: nothing on the device can be trusted after one."""
        try:
            fn(*args)
        except MtpUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - attributable to this request: it alone fails
            if is_sticky(exc):
                raise
            self._fail_request(req, exc)

    def _fail_request(self, req: StepRequest, exc: BaseException) -> None:
        self._non_finite_ended |= isinstance(exc, NonFiniteLogits)
        event = error_event(exc, f"engine.request {req.request_id}", self.device)
        self.bus.publish(event)
        if not self._result.skips(req):
            self._result.failed.append(RequestFailure(req, event.message))

    def _mtp_off(self, exc: BaseException) -> None:
        message = real_message(exc)
        self.mtp_on = False
        self.mtp_off_reason = message
        self._result.draft_tokens = 0
        # The drafter's graphs will never replay again: give their pool back (the tier can grow into it).
        freed_mib = self.graphs.release("drafter")
        self.bus.publish(WarningEvent(where="engine.mtp",
                                      message=f"MTP drafting turned off for the rest of the run "
                                              f"(freed {freed_mib:.0f} MiB of drafter graphs): {message}"))
