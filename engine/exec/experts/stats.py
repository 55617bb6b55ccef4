"""ExpertStats: the expert cache's counters, its routing trace, the summed load / evict events, and the oracle.

Per layer: hits and misses (one per expert of an access, engine.exec.experts.trace), evictions, experts copied
in (`loaded`) and of those the ones copied in by steps that ran prompt chunks (`prompt_loaded`: a prompt's
cost in crossings, which a layer-major prefill window brings to one per cold expert, window and layer);
overall: experts loaded, MiB copied (and the prompt steps' share), copy ms. The trace keeps the newest `trace_max` accesses; `snapshot` replays it
with Belady's furthest-next-use rule at the current slot count (the *oracle* hit rate: what a perfect
policy with this budget would have hit on the same routing), with LRU, and with the live policy when that is
not LRU (the EXPERT_LFU switch); the live policy's replay equals the live rate while the budget and the policy
did not move. So a user can tell whether a bigger budget or a better policy would help.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from engine.exec.experts.trace import Access, hit_rate, replay, write_trace
from engine.snapshot import ExpertCacheSnapshot, ExpertLayerSnapshot
from engine.telemetry import EventBus, ExpertEvent

EVENT_INTERVAL_S = 1.0  # load / evict events are summed over about this long
TRACE_MAX_ACCESSES = 200_000
# The oracle's replays walk the whole trace in Python: a snapshot published while steps run (every 50 ms, on the
# engine thread) reuses one at most this old instead of replaying it again.
ORACLE_REFRESH_S = 2.0
# the step kinds that run prompt chunks (engine.exec.runner's prefill, a layer-major window of them too, and MTP's
# drafter prefill beside each): what their copies cost counts as the prompts'
PROMPT_KINDS = ("prefill", "draft_prefill")


class ExpertStats:
    def __init__(self, num_layers: int, num_experts: int, bus: EventBus, device: str,
                 trace_max: int = TRACE_MAX_ACCESSES) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.bus = bus
        self.device = device
        self.hits = [0] * num_layers
        self.misses = [0] * num_layers
        self.evictions = [0] * num_layers
        self.loaded = [0] * num_layers  # experts copied into each layer's pool (a miss, a prefetch, the start)
        self.prompt_loaded = [0] * num_layers  # of those, copied in by steps that ran prompt chunks
        self.prompt_loaded_mib = 0.0
        self.loaded_experts = 0
        self.loaded_mib = 0.0
        self.load_ms = 0.0
        self.reruns = 0  # captured steps run again eagerly because an expert was missing
        self.replays = 0  # extra graph replays after loading a captured step's first missed layer
        self.prefetched = 0  # experts copied in ahead of their layer (the cold mode prefetch)
        self.host_runs = 0  # misses run on the CPU from the host store (the cold mode cpu)
        self.steps = 0
        self.step_kind = ""
        self.trace: deque[Access] = deque(maxlen=trace_max)
        self._pending_events: list[tuple[Any, Any]] = []  # CUDA (start, end) of copies not yet timed
        self._window = {"experts": 0, "mib": 0.0, "ms": 0.0, "evicted": 0}
        self._last_publish_s = float("-inf")  # the first loads are published at once
        self._oracle: tuple[tuple, float, dict[str, float | None]] | None = None  # key, when, rates

    # --- recording (the cache calls these) ----------------------------------------------------------------

    def begin_step(self, kind: str) -> None:
        self.steps += 1
        self.step_kind = kind

    def record_access(self, layer: int, experts: list[int], tokens: int, step: int | None = None,
                      kind: str | None = None) -> None:
        """One layer's access in this step (or in `step` of `kind`, for counters read a step late)."""
        self.trace.append(Access(self.steps if step is None else step, layer, tuple(experts), tokens,
                                 self.step_kind if kind is None else kind))

    def record_group(self, layer: int, hits: int, misses: int, evicted: int) -> None:
        self.hits[layer] += hits
        self.misses[layer] += misses
        self.evictions[layer] += evicted
        self._window["evicted"] += evicted

    def record_loads(self, layer: int, experts: int, mib: float, cuda_events: tuple[Any, Any],
                     host_s: float) -> None:
        """`experts` (`mib` in all) copied into `layer`'s pool (timed by the CUDA events, or `host_s` on a CPU)."""
        self.loaded[layer] += experts
        if self.step_kind in PROMPT_KINDS:
            self.prompt_loaded[layer] += experts
            self.prompt_loaded_mib += mib
        self.loaded_experts += experts
        self.loaded_mib += mib
        self._window["experts"] += experts
        self._window["mib"] += mib
        if cuda_events[0] is not None:
            self._pending_events.append(cuda_events)
        else:
            self.load_ms += host_s * 1e3
            self._window["ms"] += host_s * 1e3

    # --- events ----------------------------------------------------------------------------------------------

    def publish_due(self, total_mib: float, slots: int, force: bool = False, policy: str = "lru") -> None:
        """Publish the summed load / evict events of the last ~second (between steps, after a sync)."""
        now = time.monotonic()
        if not force and now - self._last_publish_s < EVENT_INTERVAL_S:
            return
        self._last_publish_s = now
        pending = []
        for start, end in self._pending_events:  # copies still running are timed at a later publish
            if not end.query():
                pending.append((start, end))
                continue
            ms = start.elapsed_time(end)
            self.load_ms += ms
            self._window["ms"] += ms
        self._pending_events = pending
        w = self._window
        if w["experts"]:
            self.bus.publish(ExpertEvent(action="load", experts=w["experts"], mib=round(w["mib"], 3),
                                         total_mib=round(total_mib, 3), slots=slots, ms=round(w["ms"], 3),
                                         reason="miss", device=self.device))
        if w["evicted"]:
            self.bus.publish(ExpertEvent(action="evict", experts=w["evicted"], total_mib=round(total_mib, 3),
                                         slots=slots, reason=policy, device=self.device))
        self._window = {"experts": 0, "mib": 0.0, "ms": 0.0, "evicted": 0}

    # --- views -----------------------------------------------------------------------------------------------

    def oracle(self, slots: int, max_age_s: float = 0.0, policy: str = "lru") -> dict[str, float | None]:
        """Hit rates of the recorded trace replayed at `slots` per layer: Belady (oracle), LRU, and the live
        `policy` when it is not LRU. Replayed again only when the trace, the slots or the policy changed and the
        last replay is older than `max_age_s`."""
        kinds = ("lru",) if policy == "lru" else ("lru", policy)
        if slots >= self.num_experts:  # every expert preloaded: nothing can miss
            return {"oracle_hit_rate": 1.0, **{f"{k}_replay_hit_rate": 1.0 for k in kinds}}
        key, now_s = (slots, len(self.trace), self.steps, policy), time.monotonic()
        if self._oracle is not None and self._oracle[0][3] == policy and (
                self._oracle[0] == key or now_s - self._oracle[1] < max_age_s):
            return self._oracle[2]
        trace = list(self.trace)
        rates = {"oracle_hit_rate": hit_rate(replay(trace, slots, "belady")),
                 **{f"{k}_replay_hit_rate": hit_rate(replay(trace, slots, k)) for k in kinds}}
        self._oracle = (key, now_s, rates)
        return rates

    def write_trace(self, path: str, header: dict) -> None:
        write_trace(path, {"num_layers": self.num_layers, "num_experts": self.num_experts, **header}, self.trace)

    def snapshot(self, oracle_max_age_s: float = 0.0, policy: str = "lru", **sizes: Any) -> ExpertCacheSnapshot:
        """The counters, with the cache's `sizes` (ExpertCacheSnapshot's size fields) and the oracle's replays
        at its slots (up to `oracle_max_age_s` old)."""
        hits, misses = sum(self.hits), sum(self.misses)
        layers = [ExpertLayerSnapshot(layer=i, hits=h, misses=m, evictions=ev, loaded=ld, prompt_loaded=pl,
                                      hit_rate=round(h / (h + m), 4) if h + m else None)
                  for i, (h, m, ev, ld, pl) in enumerate(zip(self.hits, self.misses, self.evictions, self.loaded,
                                                             self.prompt_loaded))]
        rates = self.oracle(int(sizes["slots"]), oracle_max_age_s, policy)
        return ExpertCacheSnapshot(
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in sizes.items()},
            num_layers=self.num_layers, num_experts=self.num_experts, policy=policy, device=self.device,
            hits=hits, misses=misses, hit_rate=round(hits / (hits + misses), 4) if hits + misses else None,
            evictions=sum(self.evictions), loaded_experts=self.loaded_experts, loaded_mib=round(self.loaded_mib, 3),
            prompt_loaded_experts=sum(self.prompt_loaded), prompt_loaded_mib=round(self.prompt_loaded_mib, 3),
            load_ms=round(self.load_ms, 3), reruns=self.reruns, replays=self.replays, prefetched=self.prefetched,
            host_runs=self.host_runs, steps=self.steps, trace_accesses=len(self.trace), layers=layers,
            **{k: None if v is None else round(v, 4) for k, v in rates.items()})
