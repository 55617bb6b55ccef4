"""Engine: add_request / step / abort over the scheduler, the runner, the MTP drafter and the adaptive tier.

One step runs what the scheduler's StepPlan says: map (or copy) reused prefix blocks into newly admitted slots, one
batched decode (or MTP verify + draft round) of every decoding slot, the plan's prefill chunks, then the
cache fills. It returns the RequestOutput increments of that step (text detokenized, stop strings cut). On CUDA,
while slots decode, a prompt chunk instead runs beside the steps on a side stream (engine.exec.chunk_stream): the
step that plans it launches it before its decode, and a later step lands it first thing (its first token, MTP's
drafter prefill, its cache fill) once its kernels are done.

Not thread-safe: one thread steps it (engine.orchestration.async_engine.AsyncEngine runs it in its engine thread).
Failures, from mild to fatal: a graph that cannot be captured degrades its switch or turns MTP off (runner);
an eager out-of-memory gets room from the tier and is retried once (runner); anything else inside a step is
an ErrorEvent with the real message (the __cause__/__context__ chain, "no error" links skipped) that ends the
requests holding a slot; a sticky CUDA error, or a failure that repeats step after step, is fatal: health
"dead: ...", and every request finished with the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import torch

from engine.api import Health, HealthStatus, RequestOutput, SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine_setup import EngineParts, build_parts, release_device_memory
from engine.errors import EngineDead, NoExpertCache, RequestRejected
from engine.core.output import OutputProcessor, Track
from engine.exec.experts.setup import check_min_budget
from engine.exec.experts.stats import ORACLE_REFRESH_S
from engine.exec.experts.steps import follow_policy_switch
from engine.exec.gpu_errors import error_event, is_sticky, real_message
from engine.core.request import Request
from engine.core.prefill_pacer import ChunkTiming, StepTiming
from engine.exec.runner import MtpUnavailable, Row
from engine.exec.sampler import (NonFiniteLogits, SampleResult, device_result, non_finite_rows, request_generator,
                                 sample_isolating_rows, sample_with_drafts)
from engine.core.scheduler import Admission, PrefillChunk, StepPlan
from engine.snapshot import EngineSnapshot, MtpSnapshot
from engine.orchestration.reporting import Reporter
from engine.orchestration.state import build_snapshot
from engine.switches import SwitchState
from engine.telemetry import AdmissionEvent, EngineEvent, EventBus, SlotEvent, WarningEvent

# /strata/state is at most this stale while steps run; AsyncEngine publishes after each batch of commands
SNAPSHOT_INTERVAL_S = 0.05
MAX_FAILED_STEPS = 3  # non-sticky step failures with no request finishing in between: then the engine gives up


class Engine:
    """The serving core. `step()` returns this step's RequestOutput increments."""

    def __init__(self, config: EngineConfig, bus: EventBus, *, executor: Any = None,
                 tier_budget_mib: float | None = None, block_tokens: int | None = None) -> None:
        self.config = config
        self.bus = bus
        self._dead_reason: str | None = None
        bus.publish(EngineEvent(state="loading", detail=f"model {config.model}"))
        parts: EngineParts = build_parts(config, bus, executor, tier_budget_mib, block_tokens)
        self.lm, self.kv, self.tier, self.budgets = parts.lm, parts.kv, parts.tier, parts.budgets
        self.budget = self.budgets[0]
        self.sched, self.runner, self.drafter, self.board = parts.sched, parts.runner, parts.drafter, parts.board
        self.executor = parts.executor
        self.device = parts.device
        self.chunks = parts.chunks  # prompt chunks beside the steps (engine.exec.chunk_stream), or None
        self.ahead = parts.ahead  # the next greedy decode step in flight (engine.exec.decode_ahead)
        self.model_name = config.model
        self.tokenizer = self.lm.tokenizer
        self.eos_token_ids = tuple(self.lm.eos_token_ids)
        self.vocab_size = int(self.lm.config.vocab_size)
        self.mtp_on = self.drafter is not None
        self.mtp_off_reason: str | None = None
        self.steps = 0
        self._failed_steps = 0  # since a request last finished normally
        self._non_finite_ended = False  # a request ended on NaN logits this step: the step's end scrubs the pool
        self.output = OutputProcessor(self.eos_token_ids)
        self._generators: dict[str, torch.Generator] = {}  # per request: its seeded sampling draws
        depth = self.runner.mtp_depth if self.mtp_on else 0
        self._draft_proposed = [0] * depth  # per draft position, since start (the metrics' counters)
        self._draft_accepted = [0] * depth
        self.report = Reporter(bus, self.budgets, self.executor, self.output, kv=self.kv)
        self._last_snapshot_s = 0.0
        self.snapshot = EngineSnapshot()
        self.report.vram()
        self.publish_snapshot(force=True)
        bus.publish(EngineEvent(state="ready", detail=f"model {config.model} on {self.device}"))

    # --- queries -------------------------------------------------------------------------------------------

    def health(self) -> Health:
        if self._dead_reason is not None:
            return Health(HealthStatus.DEAD, self._dead_reason)
        return Health(HealthStatus.READY)

    @property
    def has_work(self) -> bool:
        return self.sched.has_work

    def state(self) -> EngineSnapshot:
        """/strata/state now (engine thread): a fresh snapshot, published."""
        self.publish_snapshot(force=True, fresh=True)
        return self.snapshot

    def publish_snapshot(self, force: bool = False, fresh: bool = False) -> None:
        """Build the snapshot on the engine thread and publish it by swapping one reference: readers on other
        threads (AsyncEngine.state, the metrics scrape) see a whole snapshot and never touch live state.
        `fresh`: also replay the expert trace's oracle now (a paced publish reuses one up to ORACLE_REFRESH_S old)."""
        now_s = time.monotonic()
        if not force and now_s - self._last_snapshot_s < SNAPSHOT_INTERVAL_S:
            return
        self._last_snapshot_s = now_s
        mtp = MtpSnapshot(enabled=self.mtp_on, depth=self.config.mtp_depth if self.config.batch_mtp else 0,
                          disabled_reason=self.mtp_off_reason, draft_proposed=list(self._draft_proposed),
                          draft_accepted=list(self._draft_accepted))
        self.snapshot = build_snapshot(
            model=self.model_name, config=self.config, health=self.health(), board=self.board, sched=self.sched,
            executor=self.executor, budgets=self.budgets, tier=self.tier, kv=self.kv, mtp=mtp, steps=self.steps,
            experts=self.lm.model.expert_provider, oracle_max_age_s=0.0 if fresh else ORACLE_REFRESH_S, now_s=now_s)

    # --- commands ------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises RequestRejected / PromptTooLong / MaxTokensTooLarge / QueueFull / EngineDead.

        Atomic: everything the request needs is validated and built first and the scheduler takes it last, so
        a failure at any stage leaves the engine exactly as it was (a seed torch refused once left a request
        in the scheduler with no generator, and the next three steps failed)."""
        if self._dead_reason is not None:
            raise EngineDead(self._dead_reason)
        # min / max scan in C; the generator names the first bad id only when there is one (a 176K prompt)
        in_range = not prompt_token_ids or (min(prompt_token_ids) >= 0 and max(prompt_token_ids) < self.vocab_size)
        bad = None if in_range else next(t for t in prompt_token_ids if not 0 <= t < self.vocab_size)
        if bad is not None:  # an out-of-range id would fail inside the embedding and take the step down
            raise RequestRejected(f"prompt token id {bad} is outside this model's vocabulary "
                                  f"(0..{self.vocab_size - 1})", param="prompt")
        generator = request_generator(params, self.vocab_size)  # RequestRejected naming seed or logit_bias
        req = Request(request_id, prompt_token_ids, params, arrival_s=time.monotonic())
        decoder = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        self.sched.add(req)  # the commit point: it validates before it queues, so a refusal leaves nothing
        self.output.add(req, decoder)
        self._generators[request_id] = generator
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request; returns its final output, or None when it is not active."""
        track = self.output.get(request_id)
        if track is None:
            return None
        self.ahead.drop()  # it may write the slot's blocks, which go back below
        slot = track.request.slot
        self.sched.finish(track.request, "abort")
        final = self._close(track, "abort", slot)
        if self._dead_reason is None:  # between steps: its mapped blocks (a discarded last fill too) go now
            self.tier.reclaim_retired()
        return final

    def set_vram_reserve(self, mib: int) -> int:
        """Retune the reserve on every device live (the tier shrinks at once if the reserve is not free)."""
        self.ahead.drop()  # the tier may give blocks back to the pool
        for budget in self.budgets:
            budget.set_reserve(mib)
        self.report.vram(force=True)
        return int(self.budget.reserve_mib)

    def set_expert_cache_mib(self, mib: int) -> dict[str, Any]:
        """Retune the MoE expert cache's budget live (engine.exec.kv.tier.VramBudget.set_expert_budget); returns the
        cache's snapshot afterwards. NoExpertCache for a dense model, ConfigError (mib) below one slot a layer."""
        cache = self.lm.model.expert_provider
        if cache is None:
            raise NoExpertCache(f"the model {self.model_name} has no MoE layers: there is no expert cache to resize")
        check_min_budget(cache, mib, "mib")
        budget = next(b for b in self.budgets if b.experts is cache)
        budget.set_expert_budget(mib, f"expert cache set to {mib} MiB")
        self.report.vram(force=True)
        return cache.snapshot()

    def set_switch(self, name: str, enabled: bool) -> SwitchState:
        """Toggle a live switch (SwitchNeedsRestart / UnknownSwitch otherwise) and drop the graphs it alters."""
        self.ahead.drop()  # the graphs it replays may be dropped below
        state = self.board.set_live(name, enabled)
        self.runner.on_switch_changed(state.name)
        if self.lm.model.expert_provider is not None:  # EXPERT_LFU: the snapshot says the new policy at once
            follow_policy_switch(self.lm.model.expert_provider, self.board)
        return state

    def close(self) -> None:
        """Give the device memory back now (graphs, tier, KV cache, weights), for an in-process caller that
        builds another engine next; it cannot serve afterwards. A server process simply exits instead."""
        self._dead_reason = self._dead_reason or "closed"
        self.ahead.drop()
        if self.chunks is not None:
            with contextlib.suppress(Exception):  # a failed chunk: closing gives its memory back all the same
                self.chunks.drop(wait=True)
        release_device_memory(self.executor, self.tier, self.kv, self.lm.model, self.device)

    def idle_tick(self) -> None:
        """Between steps when there is no work: keep the VRAM books and events (~1/s) and the tier size fresh."""
        if self._dead_reason is None:
            self.report.vram()
        self.publish_snapshot()

    # --- the step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one planned step; returns the outputs it produced (empty when idle)."""
        if self._dead_reason is not None:
            return []
        outputs: list[RequestOutput] = []
        try:
            with torch.inference_mode(), self.chunks.steps() if self._may_overlap() else contextlib.nullcontext():
                landed = self._land_chunk(outputs)  # first: its request may decode in this very step
                plan = self.sched.schedule()
                now_s = time.monotonic()
                self.kv.reclaim_retired()  # finished requests' pool and host blocks (--kv-resident)
                self.tier.reclaim_retired()  # finished requests' mapped tier blocks (a shared tier)
                for admission in plan.admitted:
                    self._isolated(admission.request, outputs, self._admit, admission, now_s)
                timing = self._run_timed(plan, outputs, landed)
                self.tier.reclaim_retired()  # the step's fills are done: what finished maps nothing now
                if self._non_finite_ended:  # a request ended on NaN logits: its blocks must not reach another
                    self._non_finite_ended = False
                    self.tier.scrub_non_finite(req.slot for req in self.sched.running())
            self.sched.record_step(timing)
            self.steps += 1
            if any(o.finished and o.finish_reason not in ("abort", "error") for o in outputs):
                self._failed_steps = 0  # a request made it to its end: whatever failed before is not every step
            self.report.progress(time.monotonic())
            # slots taken or freed are published at once; progress alone at most every SNAPSHOT_INTERVAL_S
            self.publish_snapshot(force=bool(plan.admitted) or any(o.finished for o in outputs))
        except Exception as exc:  # noqa: BLE001 - any failure inside a step is reported; _fail decides how bad
            outputs.extend(self._fail(exc))
            self.publish_snapshot(force=True)
        return outputs

    def _run_timed(self, plan: StepPlan, outputs: list[RequestOutput], landed: list[ChunkTiming]) -> StepTiming:
        """Decode, prefill and fill the plan, timing each part for the scheduler's prefill pacing (`landed`: the
        chunks beside the steps that landed at this step's start).

        Each part ends on a device sync: a chunk's kernels would otherwise still be running when the next
        part's clock starts, and its cost would be billed to decode. A decode ends on one already (sampling
        copies its tokens to the host), and a step leaves the device idle, so a plain decode step pays for no
        extra sync (each costs tens of microseconds of host time on a step of about a millisecond).
        """
        decode_s = None
        t0_s = self._synced_clock() if plan.admitted else time.perf_counter()  # admissions queue KV copies
        for chunk in plan.prefill:  # a chunk beside the steps first: the side stream starts on it at once
            if chunk.beside_decode and not chunk.request.is_finished:
                self._isolated(chunk.request, outputs, self.chunks.launch, chunk, lambda c=chunk: self._forward(c))
        beside = self.chunks is not None and self.chunks.in_flight is not None
        if plan.decode:
            t0_s = self._synced_clock() if beside else t0_s  # the launch's host time is not decode's
            self._decode(plan.decode, outputs)
            # MTP's draft round runs after the sampling sync: drain it when a chunk's clock starts next.
            decode_s = (self._synced_clock() if plan.prefill and not beside else time.perf_counter()) - t0_s
            # a step taken ahead: its device time (the host only waited for its last part)
            decode_s = self.ahead.step_period_s() or decode_s
        chunks: list[ChunkTiming] = []
        for chunk in plan.prefill:
            if chunk.request.is_finished or chunk.beside_decode:  # aborted since schedule(), or launched above
                continue
            t0_s = self._synced_clock()
            self._isolated(chunk.request, outputs, self._prefill, chunk, outputs)
            chunks.append(ChunkTiming(chunk.start, chunk.num_tokens, self._synced_clock() - t0_s))
        fill_s = 0.0
        if plan.cache_fill:
            t0_s = self._synced_clock()
            self._fill(plan.cache_fill)
            fill_s = self._synced_clock() - t0_s
        return StepTiming(decode_s, len(plan.decode), chunks, fill_s, beside_chunk=beside, landed=landed)

    def _fill(self, fills: list) -> None:
        for fill in fills:
            failed = self.tier.fill(fill.blocks, fill.slot, fill.later_blocks(self.tier.block_tokens))
            if failed:
                self.sched.prefix_index.discard(failed)

    def _may_overlap(self) -> bool:
        """A chunk is in flight or may be launched this step: the step runs on the steps' stream (otherwise on
        the caller's, which saves a plain decode step two stream waits; the streams are ordered either way)."""
        return self.chunks is not None and (self.chunks.in_flight is not None or self.sched.has_prompt_work)

    def _synced_clock(self) -> float:
        """perf_counter after the device has finished the work queued so far (on the steps' stream only, where
        chunks may run beside the steps: a chunk in flight keeps running)."""
        if self.chunks is not None:
            self.chunks.sync()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _land_chunk(self, outputs: list[RequestOutput]) -> list[ChunkTiming]:
        """The chunk beside the steps, once its kernels are done (waited for when no slot decodes: nothing else
        would run): its first token, its drafter prefill and its cache fill. Its timing, for StepTiming.landed."""
        if self.chunks is None or self.chunks.in_flight is None:
            return []
        if not self.chunks.ready() and self.sched.num_decoding:
            return []
        flight = self.chunks.take()
        chunk = flight.chunk
        fill = self.sched.chunk_landed(chunk, flight.seconds)
        if not chunk.request.is_finished:
            self._isolated(chunk.request, outputs, self._chunk_ran, chunk, flight.out, outputs)
        if fill is not None:
            self._fill([fill])
        return [ChunkTiming(chunk.start, chunk.num_tokens, flight.seconds)]

    def _admit(self, admission: Admission, now_s: float) -> None:
        req = admission.request
        if admission.cached_blocks:
            self.tier.load(admission.cached_blocks, admission.slot)
            self.sched.release_prefix(req)
        self.bus.publish(AdmissionEvent(request_id=req.request_id, slot=admission.slot, reuse=admission.reuse,
                                        prompt_tokens=req.num_prompt_tokens, cached_tokens=admission.cached_tokens,
                                        queued_s=round(req.queued_s or 0.0, 4)))
        self.report.slot(req, admission.slot, "prefill", now_s)

    def _decode(self, reqs: list[Request], outputs: list[RequestOutput]) -> None:
        """Decode (or verify) every decoding slot: one batched forward per group of similar lengths."""
        extra = self.runner.mtp_depth + 1 if self.mtp_on else 1
        for group in self.runner.span_groups([req.num_tokens - 1 + extra for req in reqs]):
            self._decode_group([reqs[i] for i in group], outputs)

    def _decode_group(self, reqs: list[Request], outputs: list[RequestOutput]) -> None:
        rows = [Row(req.slot, req.output_token_ids[-1], req.num_tokens - 1) for req in reqs]
        params = [req.params for req in reqs]
        gens = [self._generators[req.request_id] for req in reqs]
        histories = [(req.prompt_token_ids, req.output_token_ids) for req in reqs]
        result = None
        failed: dict[int, BaseException] = {}
        # The fused step samples on the device with temperature and top_p only: anything more takes the
        # separate verify + sample + round path (same tokens, two graph kinds instead of one).
        on_device = not any(p.penalized or p.top_k or p.min_p or p.logprobs is not None for p in params)
        if self.mtp_on:
            try:
                if self.drafter.fused and on_device:
                    step = self.ahead.take(rows, "verify")
                    if step is None:
                        step = self.drafter.verify_and_draft(rows, params, gens)
                    if self._goes_ahead(reqs, params) and self.ahead.next_verify_fits(rows, step):
                        result = self.ahead.read_and_launch_verify(rows, step)
                    else:
                        result = device_result(step.emitted, len(rows))
                    failed = non_finite_rows(result)  # the step's finite check, read with its tokens
                    self._record_drafts(reqs, result.accepted)
                else:
                    out = self.runner.verify(rows)
                    result, failed = sample_isolating_rows(out.logits, out.drafts, params, gens, histories, is_sticky)
                    self._record_drafts(reqs, result.accepted)
                    pending = [Row(r.slot, toks[-1], r.position + len(toks)) for r, toks in zip(rows, result.tokens)]
                    self.drafter.round(pending, out.hidden, result.tokens, [r.position for r in rows])
            except MtpUnavailable as exc:  # a verify that failed emitted nothing: result None, plain decode
                self._mtp_off(exc)
        if result is None:
            out = self.ahead.take(rows)
            out = self.runner.decode(rows) if out is None else out
            if self._goes_ahead(reqs, params) and self.ahead.next_rows_fit(rows, out):
                result = SampleResult([0] * len(rows), self.ahead.read_and_launch(rows, out))
                failed = non_finite_rows(result)  # the step's finite check, read with its tokens
            else:
                result, failed = sample_isolating_rows(out.logits, None, params, gens, histories, is_sticky, out.best)
        now_s = time.monotonic()
        logprobs = result.logprobs or [None] * len(reqs)
        for i, (req, tokens) in enumerate(zip(reqs, result.tokens)):
            if i in failed:
                self._fail_request(req, failed[i], outputs)
            else:
                self._isolated(req, outputs, self._append, req, tokens, now_s, outputs, logprobs[i])
        if self.ahead.pending and any(req.is_finished for req in reqs):
            self.ahead.drop()  # its slot's blocks go back at the next step: the step in flight writes them

    def _goes_ahead(self, reqs: list[Request], params: list[SamplingParams]) -> bool:
        """The next step may be launched before this one's tokens are read (engine.exec.decode_ahead): every
        decoding slot is in this group, all greedy, each has room for another step (MTP's: K + 1 tokens more
        than this one may emit), and no prompt chunk will run between the steps (chunks beside the steps run on
        their own stream: a chunk that lands, making its request decode, drops the step launched ahead)."""
        quiet = self.chunks is not None or not (self.sched.prompt_work_next or self.sched.chunk_in_flight)
        room = 2 * (self.runner.mtp_depth + 1) if self.mtp_on else 1
        return (self.ahead.enabled and len(reqs) == self.sched.num_decoding and quiet
                and all(p.temperature <= 0 and not p.penalized and p.logprobs is None for p in params)
                and all(req.num_output_tokens + room < req.max_tokens for req in reqs))

    def _record_drafts(self, reqs: list[Request], accepted: list[int]) -> None:
        depth = self.runner.mtp_depth
        for req, n in zip(reqs, accepted):
            req.record_drafts(depth, n)
            for position in range(depth):
                self._draft_proposed[position] += 1
                self._draft_accepted[position] += position < n

    def _prefill(self, chunk: PrefillChunk, outputs: list[RequestOutput]) -> None:
        if chunk.request.is_finished:  # aborted between schedule() and now
            return
        with self.chunks.lane() if self.chunks is not None else contextlib.nullcontext():
            out = self._forward(chunk)
        self._chunk_ran(chunk, out, outputs)

    def _forward(self, chunk: PrefillChunk) -> Any:
        """The chunk's forward (StepOutput): on the current stream, or the side stream's (ChunkStream.launch)."""
        return self.runner.prefill(chunk.slot, chunk.request.prompt_token_ids[chunk.start:chunk.end], chunk.start)

    def _chunk_ran(self, chunk: PrefillChunk, out: Any, outputs: list[RequestOutput]) -> None:
        """After a chunk's forward: the first token of a last chunk, and MTP's drafter prefill."""
        req = chunk.request
        prompt = req.prompt_token_ids
        req.chunk_ran(chunk.end - chunk.start)
        first: int | None = None
        first_logprobs = None
        if chunk.is_last:
            generator = self._generators[req.request_id]
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
        if first is not None:
            self._append(req, [first], time.monotonic(), outputs, first_logprobs)
            if not req.is_finished:
                self.report.slot(req, chunk.slot, "decode", time.monotonic())

    def _append(self, req: Request, tokens: list[int], now_s: float, outputs: list[RequestOutput],
                logprobs: list | None = None) -> None:
        """Hand a request's new tokens to output processing; finish it in the scheduler when they end it."""
        track = self.output.get(req.request_id)
        out, reason = self.output.append(track, tokens, now_s, logprobs)
        if reason is not None:
            slot = req.slot
            self.sched.finish(req, reason)
            outputs.append(self._close(track, reason, slot))
        elif out is not None:
            outputs.append(out)

    def _close(self, track: Track, reason, slot: int | None, error: str | None = None) -> RequestOutput:
        """The final output of a finished request; frees its engine-side state and tells its slot's watchers."""
        self._generators.pop(track.request.request_id, None)
        final = self.output.close(track, reason, error)
        if self.chunks is not None and self.chunks.holds(track.request):
            self.chunks.drop(wait=self._dead_reason is None)  # its chunk writes the slot's blocks until it ends
        if slot is not None:
            self.kv.retire_slot(slot)
            self.tier.retire_slot(slot)
            state = {"abort": "aborted", "error": "error"}.get(reason, "finished")
            self.report.slot(track.request, slot, state, time.monotonic())
            self.bus.publish(SlotEvent(slot=slot, state="idle"))
        return final

    # --- failure paths -------------------------------------------------------------------------------------

    def _isolated(self, req: Request, outputs: list[RequestOutput], fn: Callable[..., None], *args: Any) -> None:
        """Run one request's own part of a step (admission, a prefill chunk, output processing): a failure
        there ends that request only. A sticky CUDA error still goes up to `_fail`: nothing on the device
        can be trusted after one."""
        try:
            fn(*args)
        except MtpUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - attributable to this request: it alone fails
            if is_sticky(exc):
                raise
            self._fail_request(req, exc, outputs)

    def _fail_request(self, req: Request, exc: BaseException, outputs: list[RequestOutput]) -> None:
        self._non_finite_ended |= isinstance(exc, NonFiniteLogits)
        event = error_event(exc, f"engine.request {req.request_id}", self.device)
        self.bus.publish(event)
        track = self.output.get(req.request_id)
        if track is None or req.is_finished:
            return
        slot = req.slot
        self.sched.finish(req, "error")
        outputs.append(self._close(track, "error", slot, error=event.message))

    def _mtp_off(self, exc: BaseException) -> None:
        message = real_message(exc)
        self.mtp_on = False
        self.mtp_off_reason = message
        self.sched.set_draft_tokens(0)
        # The drafter's graphs will never replay again: give their pool back (the tier can grow into it).
        freed_mib = self.executor.release("drafter") if self.executor is not None else 0.0
        self.bus.publish(WarningEvent(where="engine.mtp",
                                      message=f"MTP drafting turned off for the rest of the run "
                                              f"(freed {freed_mib:.0f} MiB of drafter graphs): {message}"))

    def _fail(self, exc: BaseException) -> list[RequestOutput]:
        """A step failed: report the real error (gpu_errors.error_event) and end the requests it touched.

        A sticky CUDA error (or MAX_FAILED_STEPS failed steps with no request finishing normally in between: a
        fault that repeats is not going away) is fatal: the engine is marked dead and every request ends with the
        error. Anything else ends only the requests holding a slot, whose KV the step may have left half-written
        (the scheduler discards their unfilled prefix blocks); queued requests keep their place and the engine
        serves on. A chunk in flight beside the steps is waited for (unless the error is sticky) and dropped.
        """
        event = error_event(exc, "engine.step", self.device)
        self.ahead.drop()  # waited for unless the device failed (then nothing is left to wait for)
        self._failed_steps += 1
        if not event.fatal and self._failed_steps >= MAX_FAILED_STEPS:
            event = dataclasses.replace(event, fatal=True, message=(
                f"{event.message} ({self._failed_steps} failed steps, no request finished in between)"))
        self.bus.publish(event)
        if event.fatal:
            self._dead_reason = event.message
            self.bus.publish(EngineEvent(state="dead", detail=event.message))
        if self.chunks is not None:
            # its request ends below; a sticky error leaves nothing on the device to wait for, and a failure of the
            # chunk itself is what this step's error already says
            with contextlib.suppress(Exception):
                self.chunks.drop(wait=not is_sticky(exc))
        outputs = []
        for track in self.output:
            slot = track.request.slot
            if event.fatal or slot is not None:
                self.sched.finish(track.request, "error")
                outputs.append(self._close(track, "error", slot, error=event.message))
        if not event.fatal:  # the step is over: no fill will hand blocks over into those slots
            self.tier.reclaim_retired()
        return outputs
