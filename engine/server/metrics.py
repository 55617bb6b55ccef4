"""GET /metrics: Prometheus metrics in a per-app registry.

Three sources, each used for what only it knows:
- the serving layer (per request: running/waiting, token counts, TTFT, inter-token latency),
- the telemetry bus, read by a background task (graph captures/evictions/failures, tier and VRAM MiB,
  errors and switch changes),
- `client.state()` at scrape time (MTP draft tokens proposed/accepted and acceptance per position, the
  prompt tokens waiting to prefill, and the VRAM breakdown when the snapshot carries one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineClient, RequestOutput
from engine.server.expert_metrics import expert_metric_families
from engine.server.kv_metrics import kv_metric_families
from engine.snapshot import EngineSnapshot
from engine.telemetry import AdmissionEvent, ErrorEvent, Event, GraphEvent, SwitchEvent, TierEvent, VramEvent

log = logging.getLogger("strata.server")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
VRAM_PARTS = ("total", "weights", "kv", "graphs", "tier", "reserve", "free")


@dataclass
class _Timing:
    start_s: float
    last_s: float | None = None
    tokens: int = 0
    admitted: bool = False


class ServerMetrics:
    """Every metric of one app, in its own registry (so two apps in one process never collide)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._timings: dict[str, _Timing] = {}
        self.requests = Counter("strata_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("strata_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("strata_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_ITL_BUCKETS_S, registry=r)
        self.graph_events = Counter("strata_graph_events", "Graph cache events (capture, evict, retry, wait, "
                                    "fail, degrade, release) by kind", ["action", "kind"], registry=r)
        self.tier_mib = Gauge("strata_tier_mib", "Adaptive VRAM tier size", ["device"], registry=r)
        self.vram_mib = Gauge("strata_vram_mib", "VRAM by part", ["device", "part"], registry=r)
        self.errors = Counter("strata_errors", "Engine errors reported on the bus", ["where", "fatal"], registry=r)
        self.switch_changes = Counter("strata_switch_changes", "Switch changes", ["name", "state"], registry=r)
        self.events_seen = Counter("strata_telemetry_events", "Telemetry events read", ["type"], registry=r)
        r.register(_StateCollector(client, self._server_counts))
        r.register(_HealthCollector(client))

    def _server_counts(self) -> tuple[int, int]:
        running = sum(t.admitted for t in self._timings.values())
        return running, len(self._timings) - running

    # --- serving-layer hooks -------------------------------------------------------------------------------

    def request_started(self, request_id: str) -> None:
        self._timings[request_id] = _Timing(start_s=time.perf_counter())

    def request_output(self, request_id: str, out: RequestOutput) -> None:
        timing = self._timings.get(request_id)
        if timing is None or not out.token_ids:
            return
        now = time.perf_counter()
        timing.admitted = True
        if timing.last_s is None:
            self.ttft.observe(now - timing.start_s)
            per_token = out.token_ids[1:]
        else:
            per_token = out.token_ids
        if per_token and timing.last_s is not None:
            # Several tokens in one output (MTP accepted drafts) share the gap evenly.
            gap_s = (now - timing.last_s) / len(per_token)
            for _ in per_token:
                self.itl.observe(gap_s)
        timing.last_s = now
        timing.tokens += len(out.token_ids)

    def request_finished(self, request_id: str, last: RequestOutput | None) -> None:
        self._timings.pop(request_id, None)
        reason = (last.finish_reason if last is not None else None) or "abort"
        self.requests.labels(finish_reason=reason).inc()
        if last is not None:
            self.prompt_tokens.inc(last.prompt_tokens)
            self.cached_tokens.inc(last.cached_tokens)
            self.generation_tokens.inc(last.completion_tokens)

    # --- telemetry -----------------------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        self.events_seen.labels(type=event.type).inc()
        if isinstance(event, AdmissionEvent):
            timing = self._timings.get(event.request_id)
            if timing is not None:
                timing.admitted = True
        elif isinstance(event, GraphEvent):
            self.graph_events.labels(action=event.action, kind=event.kind or "unknown").inc()
        elif isinstance(event, TierEvent):
            self.tier_mib.labels(device=event.device or "default").set(event.total_mib)
        elif isinstance(event, VramEvent):
            for part in VRAM_PARTS:
                self.vram_mib.labels(device=event.device or "default", part=part).set(getattr(event, f"{part}_mib"))
            self.tier_mib.labels(device=event.device or "default").set(event.tier_mib)
        elif isinstance(event, ErrorEvent):
            self.errors.labels(where=event.where or "unknown", fatal=str(event.fatal).lower()).inc()
        elif isinstance(event, SwitchEvent):
            self.switch_changes.labels(name=event.name, state=event.state).inc()

    async def consume_events(self, stopping: asyncio.Event, poll_s: float = 1.0) -> None:
        """Read the bus until `stopping` is set (runs as the app's background task)."""
        sub = self.client.bus.subscribe(after_seq=0, loop=asyncio.get_running_loop())
        try:
            while not stopping.is_set():
                for event in await sub.aget(poll_s):
                    try:
                        self.on_event(event)
                    except Exception:  # noqa: BLE001 - one odd event must not stop the metrics
                        log.exception("metrics: cannot account event %r", event)
        finally:
            sub.close()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Reads `client.state()` at scrape time for what the snapshot knows best; the server's own request
    tracking fills running/waiting when the snapshot lacks them."""

    def __init__(self, client: EngineClient, server_counts: Any) -> None:
        self.client = client
        self.server_counts = server_counts

    def describe(self) -> Iterable[Metric]:
        return []  # scrape-time only: nothing to describe up front

    def collect(self) -> Iterator[Metric]:
        try:
            state = self.client.state()
        except Exception as exc:  # noqa: BLE001 - a scrape during shutdown must still answer
            log.debug("metrics: state() failed: %s", exc)
            state = EngineSnapshot()
        running, waiting = request_counts(state) or self.server_counts()
        fam_r = GaugeMetricFamily("strata_requests_running", "Requests holding a slot")
        fam_r.add_metric([], float(running))
        fam_w = GaugeMetricFamily("strata_requests_waiting", "Requests queued for a slot")
        fam_w.add_metric([], float(waiting))
        yield fam_r
        yield fam_w
        # the same counts under vLLM's names (vllm:num_requests_running / _waiting), with this project's prefix
        for name, value, text in (("strata_num_requests_running", running, "Requests holding a slot"),
                                  ("strata_num_requests_waiting", waiting, "Requests queued for a slot")):
            yield GaugeMetricFamily(name, text, value=float(value))
        proposed, accepted = draft_counts(state)
        if proposed:
            fam_p = CounterMetricFamily("strata_draft_tokens_proposed", "MTP draft tokens proposed per position",
                                        labels=["position"])
            fam_a = CounterMetricFamily("strata_draft_tokens_accepted", "MTP draft tokens accepted per position",
                                        labels=["position"])
            fam_r = GaugeMetricFamily("strata_draft_acceptance_ratio", "MTP drafts accepted / proposed per "
                                      "position, since start", labels=["position"])
            for pos, n in enumerate(proposed):
                took = accepted[pos] if pos < len(accepted) else 0
                fam_p.add_metric([str(pos)], float(n))
                fam_a.add_metric([str(pos)], float(took))
                if n:
                    fam_r.add_metric([str(pos)], took / n)
            yield fam_p
            yield fam_a
            yield fam_r
        fam = GaugeMetricFamily("strata_prefill_queue_tokens", "Prompt tokens waiting to be prefilled "
                                "(queued requests and slots still prefilling)")
        fam.add_metric([], float(prefill_queue_tokens(state)))
        yield fam
        rows = vram_rows(state)
        if rows:
            fam = GaugeMetricFamily("strata_state_vram_mib", "VRAM by part from the engine snapshot",
                                    labels=["device", "part"])
            for device, part, mib in rows:
                fam.add_metric([device, part], mib)
            yield fam
        yield from expert_metric_families(state.experts)
        yield from kv_metric_families(state)


class _HealthCollector(Collector):
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("strata_engine_ready", "1 when the engine accepts requests")
        fam.add_metric([], 1.0 if self.client.health().ready else 0.0)
        yield fam


def request_counts(state: EngineSnapshot) -> tuple[int, int] | None:
    """(running, waiting) from the snapshot: its busy slots and `queue.waiting`; None before it has slots (a
    loading engine), when the server's own request tracking answers."""
    if not state.slots:
        return None
    running = sum(1 for s in state.slots if s.state not in ("idle", "finished"))
    return running, state.queue.waiting


def prefill_queue_tokens(state: EngineSnapshot) -> int:
    """Prompt tokens still to prefill: queued requests' and those in a slot."""
    return state.queue.prefill_tokens


def draft_counts(state: EngineSnapshot) -> tuple[list[int], list[int]]:
    """Per-position MTP draft totals since start: (proposed, accepted)."""
    return list(state.mtp.draft_proposed), list(state.mtp.draft_accepted)


def vram_rows(state: EngineSnapshot) -> list[tuple[str, str, float]]:
    """(device, part, MiB) of every device's VRAM books in the snapshot."""
    return [(event.device or "default", part, float(getattr(event, f"{part}_mib")))
            for event in state.vram for part in VRAM_PARTS]
