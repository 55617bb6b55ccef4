"""The engine-client interface: the one way the server, the CLI and the load scenarios talk to the engine.

Torch-free types only. The serving core implements `EngineClient` (an engine thread stepping
`Engine.step()` behind an asyncio facade); the server depends on this protocol, never on engine internals,
so its tests can drive a real engine on CPU through exactly the surface production uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, AsyncIterator, Literal, Protocol, runtime_checkable

from engine.switches import SwitchState
from engine.telemetry import EventBus

FinishReason = Literal["stop", "length", "abort", "error"]
# Temperatures below this are greedy: logits / 1e-45 overflow float32 to inf and softmax gives NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 (or below GREEDY_BELOW_TEMPERATURE) is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability; 0 keeps all
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (vLLM's rule)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds (OpenAI's rule)
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's logprob and the N most likely

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # one rule for every sampler: see the constant

    @property
    def penalized(self) -> bool:
        """Whether logits are changed before sampling (penalties or a bias): the sampler needs the history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def truncated(self) -> bool:
        """Whether the distribution is cut (top_p, top_k or min_p)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestOutput:
    """One increment of one request's output; the last one has `finished=True` and a finish reason.

    `text` is the detokenized increment with stop strings already cut; `token_ids` are the new tokens.
    Token counts are cumulative so any increment can fill in `usage`.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list["TokenLogprob"] | None = None  # one per token id, when the request asked for logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model (before temperature, penalties and truncation, as
    vLLM reports by default) and the `top` most likely tokens there, as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class HealthStatus(str, Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"  # the engine cannot serve again: a failed load, a sticky CUDA error, repeated failed steps
    STOPPED = "stopped"

    @classmethod
    def parse(cls, raw: Any) -> "HealthStatus":
        """From the wire: a status value, or an older engine's reason text ("dead: ...")."""
        text = str(raw or "")
        for status in cls:
            if text == status.value or text.startswith(status.value + ":"):
                return status
        return cls.LOADING


@dataclass(frozen=True)
class Health:
    status: HealthStatus
    detail: str = ""  # loading: what; dead: the real error

    @property
    def ready(self) -> bool:
        return self.status is HealthStatus.READY

    @property
    def dead(self) -> bool:
        return self.status is HealthStatus.DEAD

    @property
    def reason(self) -> str:
        """The wire text: "ready", "stopped", "loading: <what>", "dead: <the real error>"."""
        return f"{self.status.value}: {self.detail}" if self.detail else self.status.value


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine. Implemented by `engine.orchestration.async_engine.AsyncEngine`."""

    model_name: str
    context_tokens: int
    vocab_size: int | None  # token ids in a prompt must be below it (checked before the engine thread sees them)
    bus: EventBus

    def encode(self, text: str) -> list[int]:
        """A user's text as ids. Raises PromptTooLong past `context_tokens`, before the ids are listed."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """The rendered chat prompt's ids; PromptTooLong past `context_tokens`, as `encode`."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Admit (or queue) the request and yield its outputs. Raises RequestRejected / QueueFull /
        EngineDead before the first yield when it cannot be taken. Cancelling the iterator aborts it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> Health: ...

    def state(self) -> "EngineSnapshot":
        """Snapshot for /strata/state: config, switches, slots, graph cache, VRAM breakdown, tier.
        (engine.snapshot.EngineSnapshot: named, not imported, as that module imports this one.)"""
        ...

    async def set_switch(self, name: str, enabled: bool) -> SwitchState: ...

    async def set_vram_reserve(self, mib: int) -> int: ...

    async def set_expert_cache_mib(self, mib: int) -> "ExpertCacheSnapshot":
        """Retune the MoE expert cache's budget; returns its snapshot (engine.snapshot.ExpertCacheSnapshot).
        NoExpertCache for a dense model."""
        ...

    async def shutdown(self, wait_s: float | None = None) -> None:
        """Stop the engine; running requests end with an abort. `wait_s`: return after that long even if the
        engine is still inside a step (a long prefill chunk), so a stopping server exits in bounded time."""
        ...
