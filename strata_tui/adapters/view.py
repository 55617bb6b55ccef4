"""What the monitor shows of a vLLM, SGLang or llama.cpp server, one `EndpointView` per endpoint, whatever the
engine: every adapter maps its engine's routes and metrics onto these fields. A field the engine cannot feed
stays None and its panel carries one line in `cannot` saying so, so nothing is drawn as a stale or zero value."""

from __future__ import annotations

from dataclasses import dataclass, field

PANELS = ("requests", "kv", "prefix", "spec", "latency", "preemptions", "slots", "prefill")


@dataclass(frozen=True)
class SlotRow:
    """One llama.cpp slot: what it is doing and how far along."""

    id: int
    state: str  # idle | prefill | decode
    context_tokens: int | None  # the slot's n_ctx
    prompt_tokens: int | None  # the prompt's full length; None where the engine does not say
    prompt_done_tokens: int | None  # prompt tokens processed so far (a cached prefix counts as done)
    decoded_tokens: int | None
    task: int | None = None
    held_tokens: int | None = None  # tokens in the slot's KV cache

    @property
    def prefill_fraction(self) -> float | None:
        if self.prompt_tokens and self.prompt_done_tokens is not None:
            return min(1.0, self.prompt_done_tokens / self.prompt_tokens)
        return None


@dataclass
class EndpointView:
    url: str
    kind: str
    reachable: bool = False
    error: str = ""  # why not reachable, or which route failed
    unreachable_since: float | None = None  # wall clock of the first failure since the last success
    version: str | None = None
    model: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1 of the KV pool (vLLM blocks, SGLang tokens, llama.cpp cells)
    kv_label: str = "KV"
    prefix_hit: float | None = None  # 0..1
    spec_per_position: list[float] | None = None  # acceptance rate of draft position 1, 2, ...
    spec_mean_length: float | None = None  # accepted tokens per step, the bonus token included
    spec_rate: float | None = None  # accepted / drafted
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    latency_requests: int | None = None  # observations behind the TTFT quantiles
    preemptions: float | None = None
    prompt_tokens_s: float | None = None
    decode_tokens_s: float | None = None
    slots: list[SlotRow] | None = None
    cannot: dict[str, str] = field(default_factory=dict)  # panel -> one line on why the engine cannot feed it
    invalid: dict[str, str] = field(default_factory=dict)  # field or metric -> the value it had, out of its range
    read_at: float = 0.0  # wall clock of the last successful read

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[-1]


@dataclass
class ForeignView:
    """Every endpoint of the profile (or attachment), in order; the first is the one launched or attached."""

    kind: str
    endpoints: list[EndpointView]

    def aggregate(self) -> dict[str, float | None]:
        """Sums of requests and preemptions and the mean KV use over the endpoints that answer now."""
        live = [e for e in self.endpoints if e.reachable]

        def total(attr: str) -> float | None:
            values = [getattr(e, attr) for e in live if getattr(e, attr) is not None]
            return sum(values) if values else None

        kv = [e.kv_usage for e in live if e.kv_usage is not None]
        return {"up": float(len(live)), "running": total("running"), "waiting": total("waiting"),
                "preemptions": total("preemptions"), "kv_usage": sum(kv) / len(kv) if kv else None}
