"""The /strata/state snapshot as types: one definition the engine builds, the server sends and the TUI and the
metrics read back (before this, an untyped dict was parsed three ways). Torch-free contract.

The engine thread builds an EngineSnapshot between steps and publishes it by swapping one reference, so a
reader on another thread (the server, a Prometheus scrape) sees a whole snapshot of one moment and never
touches the scheduler, the tier or the device while the engine thread changes them.

Wire form: `to_json()` is the JSON the route has always sent (same keys; fields were only added), plus
`"v": SNAPSHOT_VERSION`. `from_json` ignores keys it does not know and defaults the ones it misses, so a TUI
and an engine of neighbouring versions still read each other.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.api import HealthStatus
from engine.telemetry import SlotEvent, VramEvent, event_from_json

SNAPSHOT_VERSION = 2

T = TypeVar("T")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A class's resolved annotations, once: get_type_hints evaluates every string annotation again on each call
    (`compile` and `eval` per field), and the engine thread builds a snapshot from these classes many times a
    second, between decode steps."""
    return typing.get_type_hints(cls)


def _from_json(cls: type[T], data: Any) -> T:
    """A dataclass from its JSON form: nested dataclasses and lists of them are parsed by their annotations."""
    if not isinstance(data, dict):
        return cls()
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        kwargs[f.name] = _value(hints[f.name], data[f.name])
    return cls(**kwargs)


def _value(hint: Any, raw: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if raw is None else _value(inner[0], raw)
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_value(item, x) for x in raw] if isinstance(raw, list) else []
    if isinstance(hint, type) and issubclass(hint, SlotEvent):
        return event_from_json({**raw, "type": "slot"})
    if isinstance(hint, type) and issubclass(hint, VramEvent):
        return event_from_json({**raw, "type": "vram"})
    if isinstance(hint, type) and issubclass(hint, HealthStatus):
        return HealthStatus.parse(raw)
    if isinstance(hint, type) and issubclass(hint, _Json):
        return hint.from_json(raw)
    return raw


class _Json:
    def to_json(self) -> dict[str, Any]:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        return _from_json(cls, data)


def _to_json(value: Any) -> Any:
    if isinstance(value, HealthStatus):
        return value.value
    if isinstance(value, (SlotEvent, VramEvent)):
        return {k: v for k, v in value.to_json().items() if k not in ("type", "v", "seq", "ts")}
    if isinstance(value, _Json):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    return value


@dataclass(frozen=True)
class HealthSnapshot(_Json):
    ready: bool = False
    reason: str = ""
    status: HealthStatus = HealthStatus.LOADING

    @classmethod
    def from_json(cls, data: Any) -> "HealthSnapshot":
        parsed = _from_json(cls, data)
        if isinstance(data, dict) and "status" not in data:  # an engine before SNAPSHOT_VERSION 2: reason text
            status = HealthStatus.READY if parsed.ready else HealthStatus.parse(parsed.reason)
            parsed = dataclasses.replace(parsed, status=status)
        return parsed


@dataclass(frozen=True)
class QueueSnapshot(_Json):
    waiting: int = 0
    queue_max: int = 0
    prefill_tokens: int = 0  # prompt tokens still to prefill: queued requests' and those in a slot
    admission_wait: str = ""  # why the head of the queue waits while a slot is free (KV by use: the pool is full)


@dataclass(frozen=True)
class GraphEntry(_Json):
    kind: str = ""
    key: str = ""
    owner: str = ""
    mib: float = 0.0
    capture_ms: float = 0.0
    replays: int = 0


@dataclass(frozen=True)
class DegradedGraph(_Json):
    kind: str = ""
    key: str = ""
    error: str = ""


@dataclass(frozen=True)
class GraphsSnapshot(_Json):
    enabled: bool = False
    device: str | None = None
    graphs: list[GraphEntry] = field(default_factory=list)
    total_mib: float = 0.0
    degraded: list[DegradedGraph] = field(default_factory=list)
    compile_cache_dir: str | None = None  # COMPILE: where compiled kernels persist between runs
    compile_cache_hits: int = 0  # compiled graphs this process took from that cache
    compile_cache_misses: int = 0  # compiled here (and stored there)


@dataclass(frozen=True)
class TierSnapshot(_Json):
    device: str = ""
    mib: float = 0.0
    capacity_mib: float = 0.0
    block_tokens: int = 0
    block_mib: float = 0.0
    capacity_blocks: int = 0
    used_blocks: int = 0
    pinned_blocks: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    evicted_blocks: int = 0
    preallocated: bool = False
    pool_blocks: int = 0  # tier blocks held in the KV pool (shared with slots by reference), of used + free
    shared_blocks: int = 0  # since start: cached blocks mapped into an admitted slot (no copy)
    copied_in_blocks: int = 0  # since start: cached blocks copied into an admitted slot (the tier's own blocks)


@dataclass(frozen=True)
class KvPagingSnapshot(_Json):
    """KV by use (and `--kv-resident`): the shared pool, host-held KV, and spill / fetch traffic since start."""

    resident_tokens: int = 0  # per slot, guaranteed on the device
    pool_blocks: int = 0
    free_pool_blocks: int = 0
    used_blocks: int = 0  # pool blocks slots hold as their own (on the device)
    tier_blocks: int = 0  # pool blocks the prefix-cache tier backs its blocks with
    borrowed_blocks: int = 0  # slots' table entries pointing at tier blocks (a prefix shared n times: n)
    preemptions: int = 0  # since start: a running slot's blocks spilled to host memory to make room (cause below)
    preemption_cause: str = ""  # why the last one happened
    paused_requests: int = 0  # decoding requests the last step left out: their KV and the others' exceed the pool
    block_tokens: int = 0
    host_mib: float = 0.0  # KV held in host memory now
    host_blocks: int = 0
    spilled_mib: float = 0.0
    fetched_mib: float = 0.0
    spill_ms: float = 0.0
    fetch_ms: float = 0.0
    spilled_blocks: int = 0
    fetched_blocks: int = 0


@dataclass(frozen=True)
class KvSnapshot(_Json):
    storage: str = ""
    mib: float = 0.0
    context_tokens: int = 0
    slots: int = 0
    paging: KvPagingSnapshot | None = None  # None: every slot keeps its whole context on the device


@dataclass(frozen=True)
class MtpSnapshot(_Json):
    enabled: bool = False
    depth: int = 0
    disabled_reason: str | None = None
    draft_proposed: list[int] = field(default_factory=list)  # per draft position, since start
    draft_accepted: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SwitchSnapshot(_Json):
    name: str = ""
    env_var: str = ""
    description: str = ""
    live: bool = False
    effect: str = ""
    enabled: bool = False
    degraded: bool = False
    unavailable: bool = False  # degraded because its code path cannot run on this engine, not because it failed
    reason: str = ""


@dataclass(frozen=True)
class ExpertLayerSnapshot(_Json):
    """One sparse layer's expert counters since start."""

    layer: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    loaded: int = 0  # experts copied into this layer's pool
    prompt_loaded: int = 0  # of those, by steps that ran prompt chunks
    hit_rate: float | None = None  # None: no access yet


@dataclass(frozen=True)
class ExpertCacheSnapshot(_Json):
    """An MoE model's expert cache (engine.exec.experts.cache.ExpertCache.snapshot): its size, its counters since
    start, and the oracle's replays of the recorded routing (engine.exec.experts.stats)."""

    slots: int = 0  # per sparse layer, held now
    target_slots: int = 0  # per sparse layer, what the budget aims for
    mib: float = 0.0  # the slot pools on the device
    host_mib: float = 0.0  # the host (pinned) store: every expert once (0 with a peer store)
    peer_mib: float = 0.0  # the store on the --peer-device card
    store_device: str = "host"
    expert_mib: float = 0.0  # one expert's weights
    all_experts_mib: float = 0.0
    top_k: int = 0
    cold: str = ""  # how a miss is served (engine.exec.experts.cold)
    num_layers: int = 0
    num_experts: int = 0
    policy: str = "lru"
    device: str = ""
    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None  # None: no access yet
    evictions: int = 0
    loaded_experts: int = 0
    loaded_mib: float = 0.0
    prompt_loaded_experts: int = 0  # copied in by steps that ran prompt chunks (their layers' prompt_loaded)
    prompt_loaded_mib: float = 0.0
    load_ms: float = 0.0
    reruns: int = 0  # captured steps run again eagerly because an expert was missing
    replays: int = 0  # extra graph replays after loading a captured step's first missed layer
    prefetched: int = 0  # experts copied in ahead of their layer (the cold mode prefetch)
    host_runs: int = 0  # misses run on the CPU from the host store (the cold mode cpu)
    steps: int = 0
    trace_accesses: int = 0
    layers: list[ExpertLayerSnapshot] = field(default_factory=list)
    oracle_hit_rate: float | None = None  # Belady's replay of the trace at the current slots
    lru_replay_hit_rate: float | None = None
    lfu_replay_hit_rate: float | None = None  # only while the live policy is LFU (EXPERT_LFU)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.policy == "lru":  # the wire carries a replay of the live policy only where it is not LRU's
            out.pop("lfu_replay_hit_rate")
        return out


@dataclass(frozen=True)
class EngineSnapshot(_Json):
    """What /strata/state answers. A loading or dead engine fills model, config and health only."""

    v: int = SNAPSHOT_VERSION
    model: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    health: HealthSnapshot = field(default_factory=HealthSnapshot)
    switches: list[SwitchSnapshot] = field(default_factory=list)
    queue: QueueSnapshot = field(default_factory=QueueSnapshot)
    slots: list[SlotEvent] = field(default_factory=list)
    graphs: GraphsSnapshot = field(default_factory=GraphsSnapshot)
    vram: list[VramEvent] = field(default_factory=list)
    tier: TierSnapshot | None = None
    kv: KvSnapshot | None = None
    mtp: MtpSnapshot = field(default_factory=MtpSnapshot)
    steps: int = 0
    experts: ExpertCacheSnapshot | None = None  # MoE: the expert cache; None: a dense model
