"""What the monitor knows about the engine, built from telemetry events. Pure Python, no Textual.

The telemetry worker feeds events in (`apply`), the `/strata/state` snapshot seeds it (`apply_snapshot`),
and each of the monitor's widgets reads its part of it on its own refresh tick (strata_tui/widgets/
view_bound.py). Keeping this apart from the widgets makes the event-to-meaning step testable in milliseconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine.snapshot import EngineSnapshot, ExpertCacheSnapshot, KvPagingSnapshot
from engine.switches import SWITCHES
from engine.telemetry import (
    AdmissionEvent,
    EngineEvent,
    ErrorEvent,
    Event,
    ExpertEvent,
    GraphEvent,
    SlotEvent,
    SwitchEvent,
    TierEvent,
    VramEvent,
    WarningEvent,
)
from strata_tui.state.expert_view import ExpertView
from strata_tui.state.prefill_eta import PrefillTrack

GRAPH_SEVERITY = {"capture": 0, "release": 0, "evict": 1, "retry": 1, "wait": 1, "fail": 2, "degrade": 2}
# The number keys 1-9 toggle the registry's first nine switches, in its order (new switches go last).
KEYED_SWITCHES = SWITCHES[:9]
GRAPH_HISTORY = 500
RECENT_EVENTS = 40
PREFILL_TRACKS = 64  # requests whose prefill (and its TTFT) is remembered


def graph_severity(event: GraphEvent) -> int:
    """0 info, 1 warning, 2 error; an event that carries an error string is at least a warning."""
    level = GRAPH_SEVERITY.get(event.action, 1)
    return max(level, 1) if event.error else level


@dataclass
class SwitchView:
    """A switch as the monitor shows it: what the profile asks for and what the engine runs with."""

    name: str
    live: bool
    wanted: bool  # the profile's value
    running: bool | None = None  # the engine's value; None before the engine has said
    degraded: bool = False
    unavailable: bool = False  # its code path cannot run on this engine (e.g. CUDA kernels on CPU): "n/a", not red
    reason: str = ""
    note: str = ""  # the last control answer (e.g. why a restart is needed)

    @property
    def needs_restart(self) -> bool:
        return self.running is not None and self.running != self.wanted and not self.degraded


@dataclass
class MonitorState:
    """The engine as seen through its events. `version` increases on every change (cheap dirty check)."""

    engine_state: str = "not started"
    engine_detail: str = ""
    exit_code: int | None = None
    slots: dict[int, SlotEvent] = field(default_factory=dict)
    vram: dict[str, VramEvent] = field(default_factory=dict)
    tier: TierEvent | None = None
    graph_events: deque[GraphEvent] = field(default_factory=lambda: deque(maxlen=GRAPH_HISTORY))
    recent: deque[Event] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    last_error: ErrorEvent | None = None
    last_warning: WarningEvent | None = None
    last_admission: AdmissionEvent | None = None
    switches: dict[str, SwitchView] = field(default_factory=dict)
    vram_reserve_mib: int | None = None
    experts: ExpertView | None = None  # an MoE engine's expert cache; None: a dense model (no panel)
    kv_pool: KvPagingSnapshot | None = None  # KV by use: the block pool's use; None: every slot holds its context
    admission_wait: str = ""  # why the queue's head waits while a slot is free (KV by use: the pool is full)
    queue_waiting: int | None = None  # requests waiting for a slot (`queue.waiting` of the last state read)
    context_tokens: int | None = None  # each slot's context (the engine's `config.context`)
    prefills: OrderedDict[str, PrefillTrack] = field(default_factory=OrderedDict)  # by request id
    last_seq: int = 0
    version: int = 0

    @classmethod
    def for_profile(cls, wanted: dict[str, bool], vram_reserve_mib: int) -> "MonitorState":
        state = cls(vram_reserve_mib=vram_reserve_mib)
        for sw in SWITCHES:
            state.switches[sw.name] = SwitchView(sw.name, sw.live, bool(wanted.get(sw.name, sw.default)))
        return state

    def reset_for_launch(self) -> None:
        """A new engine run: forget the old run's slots and numbers, keep switches' wanted values."""
        self.engine_state, self.engine_detail, self.exit_code = "starting", "", None
        self.slots.clear()
        self.vram.clear()
        self.tier, self.last_error, self.last_warning, self.last_admission = None, None, None, None
        self.experts, self.kv_pool, self.admission_wait = None, None, ""
        self.queue_waiting, self.context_tokens = None, None
        self.prefills.clear()
        self.last_seq = 0
        for view in self.switches.values():
            view.running, view.degraded, view.reason, view.note = None, False, "", ""
        self.version += 1

    def forget_engine(self) -> None:
        """Another engine answers now (restarted elsewhere): nothing the old one said still holds."""
        self.slots.clear()
        self.vram.clear()
        self.tier, self.last_admission, self.experts, self.kv_pool = None, None, None, None
        self.admission_wait, self.queue_waiting, self.context_tokens = "", None, None
        self.prefills.clear()
        self.last_seq = 0
        for view in self.switches.values():
            view.running, view.degraded, view.reason, view.note = None, False, "", ""
        self.version += 1

    def apply_all(self, events: Iterable[Event], received_s: float | None = None) -> None:
        received_s = time.monotonic() if received_s is None else received_s
        for event in events:
            self.apply(event, received_s)

    def apply(self, event: Event, received_s: float | None = None) -> None:
        """Fold one event in. `received_s`: local monotonic time it arrived (for counting ETAs down)."""
        self.last_seq = max(self.last_seq, event.seq)
        self.version += 1
        if not isinstance(event, (SlotEvent, VramEvent)):
            self.recent.append(event)
        if isinstance(event, SlotEvent):
            self.slots[event.slot] = event
            self._track_prefill(event, time.monotonic() if received_s is None else received_s)
        elif isinstance(event, VramEvent):
            self.vram[event.device or "?"] = event
            self.vram_reserve_mib = int(round(event.reserve_mib))
        elif isinstance(event, GraphEvent):
            self.graph_events.append(event)
        elif isinstance(event, TierEvent):
            self.tier = event
        elif isinstance(event, ExpertEvent):
            if self.experts is not None:  # sizes and counters come with the state snapshot
                self.experts.apply(event)
        elif isinstance(event, AdmissionEvent):
            self.last_admission = event
            track = self._prefill_track(event.request_id, event.prompt_tokens, event.cached_tokens)
            track.admitted_ts = event.ts or None  # TTFT counts from admission (queueing is not prefill)
        elif isinstance(event, SwitchEvent):
            self._apply_switch(event.name, event.state == "on", event.state in ("degraded", "unavailable"),
                               event.reason, unavailable=event.state == "unavailable")
        elif isinstance(event, EngineEvent):
            self.engine_state, self.engine_detail = event.state, event.detail
            if event.exit_code is not None:
                self.exit_code = event.exit_code
        elif isinstance(event, ErrorEvent):
            self.last_error = event
        elif isinstance(event, WarningEvent):
            self.last_warning = event

    def _prefill_track(self, request_id: str, prompt_tokens: int, cached_tokens: int) -> PrefillTrack:
        track = self.prefills.get(request_id)
        if track is None:
            track = self.prefills[request_id] = PrefillTrack(request_id, prompt_tokens, cached_tokens)
            while len(self.prefills) > PREFILL_TRACKS:
                self.prefills.popitem(last=False)
        return track

    def _track_prefill(self, event: SlotEvent, received_s: float) -> None:
        if not event.request_id or event.state not in ("prefill", "decode"):
            return
        track = self._prefill_track(event.request_id, event.prompt_tokens, event.cached_tokens)
        track.prompt_tokens, track.cached_tokens = event.prompt_tokens, event.cached_tokens
        if event.state == "prefill":
            # no prefill rate yet = no chunk has run: its tokens are planned, not computed
            track.add(event.ts, event.prefilled_tokens, received_s, event.eta_s, chunk_ran=bool(event.prefill_tok_s),
                      chunk_tok_s=event.prefill_tok_s or None)
        elif not track.done:
            track.first_token(event.ts, event.prefill_tok_s or None)

    def track_of(self, slot: SlotEvent) -> PrefillTrack | None:
        return self.prefills.get(slot.request_id) if slot.request_id else None

    def any_running(self) -> bool:
        """A slot holds a request (prefilling or decoding)."""
        return any(s.state in ("prefill", "decode") for s in self.slots.values())

    def last_ttft_s(self) -> float | None:
        """The time to first token of the request whose first token came last (None before any)."""
        done = [t for t in self.prefills.values() if t.ttft_s is not None and t.first_token_ts is not None]
        return max(done, key=lambda t: t.first_token_ts).ttft_s if done else None

    @property
    def any_prefilling(self) -> bool:
        return any(s.state == "prefill" for s in self.slots.values())

    def _apply_switch(self, name: str, enabled: bool, degraded: bool, reason: str, snapshot: bool = False,
                      unavailable: bool = False) -> None:
        view = self.switches.get(name.upper().removeprefix("STRATA_"))
        if view is None:
            return
        if snapshot and view.running is not None and view.running != enabled:
            view.note = ""  # an answer about the value before ("applied live") no longer describes it
        view.running, view.degraded, view.reason = enabled, degraded, reason
        view.unavailable = degraded and unavailable
        if degraded and not view.unavailable:  # a note on an n/a switch says what became of the key press
            view.note = ""

    def apply_switch_state(self, item: dict[str, Any]) -> None:
        """One switch as the engine reports it (a `/strata/state` entry, or a control route's answer)."""
        self.version += 1
        self._apply_switch(str(item["name"]), bool(item.get("enabled")), bool(item.get("degraded")),
                           str(item.get("reason", "")), snapshot=True, unavailable=bool(item.get("unavailable")))

    def apply_snapshot(self, snapshot: EngineSnapshot) -> None:
        """Seed from `/strata/state` (its answer through `EngineSnapshot.from_json`): the switches, the slots the
        engine has now (rows of slots it no longer has go), the VRAM books and the reserve in force, the experts."""
        self.version += 1
        for switch in snapshot.switches:
            self.apply_switch_state(switch.to_json())
        self.slots = {event.slot: event for event in snapshot.slots}
        # The reserve in force: the live VRAM books, else the configured start value (config is what the engine
        # started with; a live change since shows only in the books).
        reserve_mib = snapshot.config.get("vram_reserve_mib")
        if isinstance(reserve_mib, int):
            self.vram_reserve_mib = reserve_mib
        context = snapshot.config.get("context")
        self.context_tokens = context if isinstance(context, int) and context > 0 else None
        self.vram.clear()
        for event in snapshot.vram:
            self.vram[event.device] = event
            self.vram_reserve_mib = int(round(event.reserve_mib))
        self.apply_experts(snapshot.experts)
        self.kv_pool = snapshot.kv.paging if snapshot.kv is not None else None
        self.admission_wait = snapshot.queue.admission_wait
        self.queue_waiting = snapshot.queue.waiting

    def apply_kv_pool(self, pool: KvPagingSnapshot | None, admission_wait: str = "", waiting: int | None = None) -> None:
        """The `kv.paging` section of a state snapshot, read again while the engine serves (pool use changes every
        step and travels in no event; None: the engine keeps every slot's whole context, no pool to show), why
        the queue waits for blocks, if it does, and how many requests wait."""
        if waiting is not None and waiting != self.queue_waiting:
            self.queue_waiting = waiting
            self.version += 1
        if pool != self.kv_pool or admission_wait != self.admission_wait:
            self.kv_pool, self.admission_wait = pool, admission_wait
            self.version += 1

    def apply_experts(self, experts: ExpertCacheSnapshot | None) -> None:
        """The `experts` section of a state snapshot (or a control answer); None: a dense model."""
        self.version += 1
        if experts is None:
            self.experts = None
            return
        if self.experts is None:
            self.experts = ExpertView()
        self.experts.update(experts)

    def note_exit(self, returncode: int) -> None:
        """The launcher saw the process end."""
        self.engine_state, self.exit_code = "exited", returncode
        self.version += 1
