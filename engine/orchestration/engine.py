"""Engine: add_request / step / abort over the scheduler, the runner, the MTP drafter and the adaptive tier.

A step is three calls over the typed step data of engine.step: `plan = sched.schedule()` (engine.core.scheduler:
admissions, decodes, prefill chunks, cache fills), `result = executor.execute(plan)` (engine.exec.plan_executor:
runs it on the device, the decode path, chunks beside the steps, sampling, fills; it never sees the scheduler),
`outputs = sched.update(plan, result)` (token bookkeeping and finishing). A chunk beside the steps that landed
in the step goes between the last two: the scheduler plans its cache fill and the executor runs it before the
slot can change hands. The engine then delivers them: detokenized, stop strings cut (a stop string ends its request the way
an abort does), finished requests' slots given back (the RequestOutput increments `step` returns).

Telemetry is published here, where the slots change: an admission, a first token and an end at once, progress
paced (at most every SLOT_EVENT_INTERVAL_S a slot), the VRAM books about once a second (the events themselves
are built in `state.py` and the budgets).

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

from engine.api import Health, HealthStatus, RequestOutput, SamplingParams
from engine.config import EngineConfig
from engine.core.output import OutputProcessor, Track
from engine.core.request import Request
from engine.errors import EngineDead, NoExpertCache, RequestRejected
from engine.exec.experts.setup import check_min_budget
from engine.exec.experts.stats import ORACLE_REFRESH_S
from engine.exec.experts.steps import follow_policy_switch
from engine.exec.gpu_errors import error_event, is_sticky
from engine.exec.sampler import request_generator
from engine.exec.step_fns import StepExecutor
from engine.orchestration.engine_setup import EngineParts, build_parts, release_device_memory
from engine.orchestration.state import SlotViews, build_snapshot, slot_event
from engine.snapshot import EngineSnapshot, ExpertCacheSnapshot, MtpSnapshot
from engine.step import Admission, TokenOutput
from engine.switches import SwitchState
from engine.telemetry import AdmissionEvent, EngineEvent, EventBus, SlotEvent

# /strata/state is at most this stale while steps run; AsyncEngine publishes after each batch of commands
SNAPSHOT_INTERVAL_S = 0.05
SLOT_EVENT_INTERVAL_S = 0.1  # progress events per slot at most ~10 Hz, up to FULL_RATE_SLOTS busy slots;
# past them each slot's interval grows with their number, so all slots' progress costs a step about the same host
# time at any batch (256 slots at 10 Hz would build 2,560 events a second on the engine thread)
FULL_RATE_SLOTS = 20
VRAM_EVENT_INTERVAL_S = 1.0  # the VRAM books (each device's tier rebalanced first) about once a second
MAX_FAILED_STEPS = 3  # non-sticky step failures with no request finishing in between: then the engine gives up


class Engine:
    """The serving core. `step()` returns this step's RequestOutput increments."""

    def __init__(self, config: EngineConfig, bus: EventBus, *, graphs: StepExecutor | None = None,
                 tier_budget_mib: float | None = None, block_tokens: int | None = None) -> None:
        """`graphs`: a step executor of the caller's (a graph cache with a fault plan) instead of the default."""
        self.config = config
        self.bus = bus
        self._dead_reason: str | None = None
        bus.publish(EngineEvent(state="loading", detail=f"model {config.model}"))
        parts: EngineParts = build_parts(config, bus, graphs, tier_budget_mib, block_tokens)
        self.lm, self.kv, self.tier, self.budgets = parts.lm, parts.kv, parts.tier, parts.budgets
        self.budget = self.budgets[0]
        self.sched, self.runner, self.drafter, self.board = parts.sched, parts.runner, parts.drafter, parts.board
        self.graphs = parts.graphs  # the graph cache (eager where there are no graphs): engine.exec.step_fns
        self.executor = parts.executor  # runs each step's plan: engine.exec.plan_executor
        self.device = parts.device
        self.streams = parts.streams  # the CUDA streams and each launch's lane (engine.exec.cuda_streams)
        self.chunks = parts.chunks  # prompt chunks beside the steps (engine.exec.chunk_stream), or None
        self.ahead = parts.ahead  # the next greedy decode step in flight (engine.exec.decode_ahead)
        self.model_name = config.model
        self.tokenizer = self.lm.tokenizer
        self.eos_token_ids = tuple(self.lm.eos_token_ids)
        self.vocab_size = int(self.lm.config.vocab_size)
        self.steps = 0
        self._failed_steps = 0  # since a request last finished normally
        self.output = OutputProcessor()
        self.slot_interval_s = SLOT_EVENT_INTERVAL_S
        self._slot_views = SlotViews()
        self._last_vram_s = 0.0
        self._last_snapshot_s = 0.0
        self.snapshot = EngineSnapshot()
        self._publish_vram()
        self.publish_snapshot(force=True)
        bus.publish(EngineEvent(state="ready", detail=f"model {config.model} on {self.device}"))

    # --- queries -------------------------------------------------------------------------------------------

    def health(self) -> Health:
        if self._dead_reason is not None:
            return Health(HealthStatus.DEAD, self._dead_reason)
        return Health(HealthStatus.READY)

    @property
    def mtp_on(self) -> bool:
        return self.executor.mtp_on

    @property
    def mtp_off_reason(self) -> str | None:
        return self.executor.mtp_off_reason

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
                          disabled_reason=self.mtp_off_reason, draft_proposed=list(self.executor.draft_proposed),
                          draft_accepted=list(self.executor.draft_accepted))
        self.snapshot = build_snapshot(
            model=self.model_name, config=self.config, health=self.health(), board=self.board, sched=self.sched,
            graphs=self.graphs, budgets=self.budgets, tier=self.tier, kv=self.kv, mtp=mtp, steps=self.steps,
            experts=self.lm.model.expert_provider, oracle_max_age_s=0.0 if fresh else ORACLE_REFRESH_S, now_s=now_s,
            slot_views=self._slot_views, slot_max_age_s=self._slot_views_max_age_s())

    def _slot_views_max_age_s(self) -> float:
        """How old a snapshot's slot entry may be: 0 up to FULL_RATE_SLOTS busy slots, past them the slots'
        progress interval (`_publish_progress`)."""
        busy = self.sched.num_running
        return 0.0 if busy <= FULL_RATE_SLOTS else self._progress_interval_s(busy)

    def _progress_interval_s(self, busy: int) -> float:
        return self.slot_interval_s * max(1.0, busy / FULL_RATE_SLOTS)

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
        self.executor.generators[request_id] = generator
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request; returns its final output, or None when it is not active."""
        track = self.output.get(request_id)
        if track is None:
            return None
        self.ahead.drop()  # it may write the slot's blocks, which go back below
        final = self._end(track, "abort", track.request.slot)
        if self._dead_reason is None:  # between steps: its mapped blocks (a discarded last fill too) go now
            self.tier.reclaim_retired()
        return final

    def set_vram_reserve(self, mib: int) -> int:
        """Retune the reserve on every device live (the tier shrinks at once if the reserve is not free)."""
        self.ahead.drop()  # the tier may give blocks back to the pool
        for budget in self.budgets:
            budget.set_reserve(mib)
        self._publish_vram(force=True)
        return int(self.budget.reserve_mib)

    def set_expert_cache_mib(self, mib: int) -> ExpertCacheSnapshot:
        """Retune the MoE expert cache's budget live (engine.exec.kv.tier.VramBudget.set_expert_budget); returns the
        cache's snapshot afterwards. NoExpertCache for a dense model, ConfigError (mib) below one slot a layer."""
        cache = self.lm.model.expert_provider
        if cache is None:
            raise NoExpertCache(f"the model {self.model_name} has no MoE layers: there is no expert cache to resize")
        check_min_budget(cache, mib, "mib")
        budget = next(b for b in self.budgets if b.experts is cache)
        budget.set_expert_budget(mib, f"expert cache set to {mib} MiB")
        self._publish_vram(force=True)
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
        release_device_memory(self.graphs, self.tier, self.kv, self.lm.model, self.device)

    def idle_tick(self) -> None:
        """Between steps when there is no work: keep the VRAM books and events (~1/s) and the tier size fresh."""
        if self._dead_reason is None:
            self._publish_vram()
        self.publish_snapshot()

    # --- telemetry: published where the state changes, paced ------------------------------------------------

    def _publish_slot(self, req: Request, slot: int, state: str | None, now_s: float) -> None:
        """A slot's state now (a change of state, or progress when `state` is None)."""
        self.bus.publish(slot_event(req, slot, state, now_s, self.kv))
        track = self.output.get(req.request_id)
        if track is not None:
            track.last_event_s = now_s

    def _publish_progress(self, now_s: float) -> None:
        """After a step: progress of every slot not reported for a while, and the books when due."""
        busy = [track for track in self.output if track.request.slot is not None]
        interval_s = self._progress_interval_s(len(busy))
        for track in busy:
            if now_s - track.last_event_s >= interval_s:
                self._publish_slot(track.request, track.request.slot, None, now_s)
        self._publish_vram()

    def _publish_vram(self, force: bool = False) -> None:
        """The VRAM books of every device, each device's tier rebalanced first; at most every
        VRAM_EVENT_INTERVAL_S unless `force` (a reserve or expert budget just changed)."""
        now_s = time.monotonic()
        if not force and now_s - self._last_vram_s < VRAM_EVENT_INTERVAL_S:
            return
        self._last_vram_s = now_s
        self.budget.graphs_mib = self.graphs.snapshot().total_mib
        for budget in self.budgets:
            budget.rebalance("periodic")
            self.bus.publish(budget.breakdown())

    # --- the step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one planned step; returns the outputs it produced (empty when idle)."""
        if self._dead_reason is not None:
            return []
        outputs: list[RequestOutput] = []
        try:
            plan = self.sched.schedule()
            result = self.executor.execute(plan)
            if result.landed is not None:  # its blocks go to the tier now, before its slot can change hands
                self.executor.fill_landed(self.sched.chunk_landed(result.landed, result.landed_s[0][2]), result)
            outputs = self._deliver(result.admitted, self.sched.update(plan, result))
            if result.error is not None:
                raise result.error
            self.steps += 1
            if any(o.finished and o.finish_reason not in ("abort", "error") for o in outputs):
                self._failed_steps = 0  # a request made it to its end: whatever failed before is not every step
            self._publish_progress(time.monotonic())
            # slots taken or freed are published at once; progress alone at most every SNAPSHOT_INTERVAL_S
            self.publish_snapshot(force=bool(plan.admitted) or any(o.finished for o in outputs))
        except Exception as exc:  # noqa: BLE001 - any failure inside a step is reported; _fail decides how bad
            outputs.extend(self._fail(exc))
            self.publish_snapshot(force=True)
        return outputs

    def _deliver(self, admitted: list[Admission], token_outputs: list[TokenOutput]) -> list[RequestOutput]:
        """The step's admissions reported, then each request's kept tokens, detokenized with stop strings cut, as
        RequestOutput increments; a request that finished gives its final output and its slot back. A stop
        string ends its request the way an abort does (with the reason "stop"); a failure in one request's
        reporting or output processing ends that request."""
        outputs: list[RequestOutput] = []
        finished = False
        for admission in admitted:
            track = self.output.get(admission.request.request_id)
            try:
                self._report_admission(admission)
            except Exception as exc:  # noqa: BLE001 - attributable to this request: it alone fails
                if is_sticky(exc) or track is None:
                    raise
                outputs.append(self._fail_request(track, exc, admission.slot))
                finished = True
        for out in token_outputs:
            track = self.output.get(out.request.request_id)
            if track is None:
                continue
            try:
                increment, stopped = self.output.append(track, out.token_ids, out.logprobs,
                                                        out.finish_reason is not None)
            except Exception as exc:  # noqa: BLE001 - attributable to this request: it alone fails
                if is_sticky(exc):
                    raise
                outputs.append(self._fail_request(track, exc, out.slot))
                finished = True
                continue
            if out.finish_reason is not None or stopped:
                outputs.append(self._end(track, out.finish_reason or "stop", out.slot, error=out.error))
                finished = True
                continue
            if increment is not None:
                outputs.append(increment)
            if out.first_token:
                self._publish_slot(out.request, out.slot, "decode", time.monotonic())
        if finished:  # the step is over: what finished maps nothing now
            self.tier.reclaim_retired()
        return outputs

    def _report_admission(self, admission: Admission) -> None:
        req = admission.request
        self.bus.publish(AdmissionEvent(request_id=req.request_id, slot=admission.slot, reuse=admission.reuse,
                                        prompt_tokens=req.num_prompt_tokens, cached_tokens=admission.cached_tokens,
                                        queued_s=round(req.queued_s or 0.0, 4)))
        self._publish_slot(req, admission.slot, "prefill", time.monotonic())

    def _fail_request(self, track: Track, exc: BaseException, slot: int | None) -> RequestOutput:
        event = error_event(exc, f"engine.request {track.request.request_id}", self.device)
        self.bus.publish(event)
        return self._end(track, "error", slot, error=event.message)

    def _end(self, track: Track, reason, slot: int | None, error: str | None = None) -> RequestOutput:
        """Finish a request in the scheduler (a no-op when `update` did already) and close it."""
        self.sched.finish(track.request, reason)
        return self._close(track, reason, slot, error)

    def _close(self, track: Track, reason, slot: int | None, error: str | None = None) -> RequestOutput:
        """The final output of a finished request; frees its engine-side state and tells its slot's watchers."""
        final = self.output.close(track, reason, error)
        self.executor.release(track.request, slot, wait=self._dead_reason is None)
        if slot is not None:
            state = {"abort": "aborted", "error": "error"}.get(reason, "finished")
            self._publish_slot(track.request, slot, state, time.monotonic())
            self.bus.publish(SlotEvent(slot=slot, state="idle"))
        return final

    # --- failure paths -------------------------------------------------------------------------------------

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
