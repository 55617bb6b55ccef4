"""The monitor's history: one sample a second of what the engine did (tok/s, queue, KV use, TTFT, the expert
cache's hit rate, VRAM, and host CPU / RAM when the engine runs on the CPU), the last 15 minutes of it, for the
history panel (strata_tui/widgets/history_panel.py). Pure Python, no Textual.

`sample(view, host)` reads what the ViewState holds now, whatever the engine's kind: a Strata engine's slots,
state and experts, or another engine's endpoints as their adapters read them (rates from their token counters),
and the GPUs NVML sees. A figure the engine cannot give is None (a gap in its line, never a 0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from strata_tui.engine_io.host_stats import HostReading

# The ViewState (strata_tui/state/view_state.py, which holds a History: typed as Any here, not imported, so the two
# modules do not import each other).
ViewState = Any

HISTORY_S = 900  # 15 minutes of one-second samples
WINDOWS_S = (60, 300, 900)  # what the zoom key steps through


def _count(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 10000 else f"{value:,.0f}"


def _pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def _secs(value: float) -> str:
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def _mib(value: float) -> str:
    return f"{value / 1024:.1f}G" if value >= 1024 else f"{value:.0f}M"


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    show: Callable[[float], str]
    upper: float | None = None  # a fixed top of the scale (a fraction's 1.0); None: the window's largest value
    style: str = "cyan"


METRICS = (
    Metric("tok_s", "tok/s", _count, style="green"),
    Metric("queue", "queue", _count, style="yellow"),
    Metric("kv", "KV use", _pct, upper=1.0, style="green"),
    Metric("ttft_s", "TTFT", _secs, style="magenta"),
    Metric("expert_hit", "experts hit", _pct, upper=1.0, style="bright_magenta"),
    Metric("vram_mib", "VRAM", _mib, style="cyan"),
    Metric("cpu_pct", "CPU", lambda v: f"{v:.0f}%", style="blue"),
    Metric("ram_mib", "RAM", _mib, style="blue"),
)
BY_KEY = {metric.key: metric for metric in METRICS}


class History:
    """The last `capacity` samples of every metric (one a second), and `version`, moved by every sample."""

    def __init__(self, capacity: int = HISTORY_S) -> None:
        self.capacity = capacity
        self.series: dict[str, deque[float | None]] = {m.key: deque(maxlen=capacity) for m in METRICS}
        self.version = 0
        self.labels: dict[str, str] = {}  # metric -> a label that says more than its default (whose CPU)

    def add(self, sample: dict[str, float | None], labels: dict[str, str] | None = None) -> None:
        for key, ring in self.series.items():
            ring.append(sample.get(key))
        if labels is not None:
            self.labels = labels
        self.version += 1

    def clear(self) -> None:
        for ring in self.series.values():
            ring.clear()
        self.version += 1

    def window(self, key: str, seconds: int) -> list[float | None]:
        ring = self.series[key]
        return list(ring)[-seconds:] if seconds < len(ring) else list(ring)

    def shown(self) -> list[Metric]:
        """The metrics with at least one value in the whole history (an engine that cannot give one has no row)."""
        return [m for m in METRICS if any(v is not None for v in self.series[m.key])]


def on_cpu(view: ViewState) -> bool:
    """The engine runs on this host's CPU: its VRAM books are the CPU's, or its profile says so, or (another
    engine's kind) NVML sees no GPU here."""
    if "cpu" in view.monitor.vram:
        return True
    if view.kind == "strata":
        profile = view.profile
        return profile is not None and not view.attached and profile.engine.device == "cpu"
    return view.gpu_unavailable is not None and not view.gpu_history.latest


def sample(view: ViewState, host: "HostReading | None" = None) -> tuple[dict[str, float | None], dict[str, str]]:
    """One sample of every metric from what the view holds now, and the labels that say whose (host or engine)."""
    out: dict[str, float | None] = dict.fromkeys(BY_KEY)
    if not view.stale:
        if view.foreign is not None:
            out.update(_foreign(view))
        elif view.kind == "strata" and view.monitor.engine_state not in ("not started", "exited"):
            out.update(_strata(view))
    gpus = [g.used_mib for g in view.gpu_history.latest if g.used_mib is not None]
    out["vram_mib"] = sum(gpus) if gpus else None
    labels: dict[str, str] = {}
    if host is not None and on_cpu(view):
        out["cpu_pct"], out["ram_mib"] = host.cpu_pct, host.ram_mib
        labels = {"cpu_pct": host.label + " CPU", "ram_mib": host.label + " RAM"}
    return out, labels


def _strata(view: ViewState) -> dict[str, float | None]:
    monitor = view.monitor
    slots = monitor.slots.values()
    rate = sum((s.prefill_tok_s if s.state == "prefill" else s.decode_tok_s) or 0.0
               for s in slots if s.state in ("prefill", "decode"))
    pool = monitor.kv_pool
    if pool is not None and pool.pool_blocks:
        # every slot idle: the blocks still counted are finished requests', given back at the next step
        kv: float | None = pool.used_blocks / pool.pool_blocks if monitor.any_running() else 0.0
    elif monitor.context_tokens and slots:
        held = sum(s.prefilled_tokens + s.generated_tokens for s in slots if s.state in ("prefill", "decode"))
        kv = held / (monitor.context_tokens * len(monitor.slots))
    else:
        kv = None
    experts = monitor.experts
    return {"tok_s": rate, "queue": monitor.queue_waiting, "kv": kv, "ttft_s": monitor.last_ttft_s(),
            "expert_hit": experts.recent_hit_rate if experts is not None else None}


def _foreign(view: ViewState) -> dict[str, float | None]:
    live = [e for e in view.foreign.endpoints if e.reachable]

    def total(*attrs: str) -> float | None:
        values = [getattr(e, a) for e in live for a in attrs if getattr(e, a) is not None]
        return sum(values) if values else None

    kv = [e.kv_usage for e in live if e.kv_usage is not None]
    ttft = [e.ttft_p50_s for e in live if e.ttft_p50_s is not None]
    return {"tok_s": total("prompt_tokens_s", "decode_tokens_s"), "queue": total("waiting"),
            "kv": sum(kv) / len(kv) if kv else None, "ttft_s": sum(ttft) / len(ttft) if ttft else None}
