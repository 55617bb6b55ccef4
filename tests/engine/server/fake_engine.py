"""A small scripted EngineClient for the server's unit tests (schemas, error mapping, auth, SSE plumbing).

It stands in for the engine, never for the server: the real-engine tests (test_real_engine.py) drive the
same server over `engine.orchestration.async_engine.AsyncEngine`. Tokens are bytes of text; the reply to a prompt is the
alphabet starting after its last byte, one token per `token_delay_s`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from engine.api import GenerationRequest, Health, HealthStatus, RequestOutput
from engine.errors import EngineDead, NoExpertCache, PromptTooLong, QueueFull
from engine.snapshot import EngineSnapshot, ExpertCacheSnapshot, MtpSnapshot, SwitchSnapshot
from engine.switches import SwitchBoard, SwitchState
from engine.telemetry import AdmissionEvent, EventBus, SlotEvent, SwitchEvent, VramEvent


class FakeEngine:
    model_name = "fake-model"

    def __init__(self, context_tokens: int = 64, token_delay_s: float = 0.0) -> None:
        self.context_tokens = context_tokens
        self.token_delay_s = token_delay_s
        self.bus = EventBus()
        self.vocab_size = 256
        self.switches = SwitchBoard.from_values({})
        self.vram_reserve_mib = 1024
        self.ready = True
        self.dead_reason: str | None = None
        self.queue_full = False
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.admitted = asyncio.Event()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if any(m["content"] == "RAISE" for m in messages):
            raise ValueError("chat template: no RAISE allowed")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        if self.queue_full:
            raise QueueFull(queued=3, limit=3, retry_after_s=2.0)
        n_prompt = len(request.prompt_token_ids)
        if n_prompt >= self.context_tokens:
            raise PromptTooLong(n_prompt, self.context_tokens)
        self.requests.append(request)
        rid = request.request_id
        self.active.add(rid)
        self.bus.publish(AdmissionEvent(request_id=rid, prompt_tokens=n_prompt))
        self.admitted.set()
        start = request.prompt_token_ids[-1]
        text = ""
        try:
            for i in range(request.params.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if rid not in self.active:
                    yield RequestOutput(rid, [], "", True, "abort", n_prompt, 0, i)
                    return
                if self.dead_reason is not None:
                    raise EngineDead(self.dead_reason)
                token = 97 + (start + i) % 26
                piece = chr(token)
                text += piece
                stop = next((s for s in request.params.stop if s in text), None)
                if stop is not None:
                    yield RequestOutput(rid, [token], piece[: len(piece) - len(stop)] if len(stop) <= 1 else "",
                                        True, "stop", n_prompt, 0, i + 1)
                    return
                last = i + 1 == request.params.max_tokens
                yield RequestOutput(rid, [token], piece, last, "length" if last else None, n_prompt, 0, i + 1)
        finally:
            self.active.discard(rid)
            self.bus.publish(SlotEvent(request_id=rid, state="idle"))

    async def abort(self, request_id: str) -> None:
        if request_id in self.active:
            self.aborted.append(request_id)
            self.active.discard(request_id)

    def health(self) -> Health:
        if self.dead_reason is not None:
            return Health(HealthStatus.DEAD, self.dead_reason)
        return Health(HealthStatus.READY) if self.ready else Health(HealthStatus.LOADING, "weights 3/7")

    def state(self) -> EngineSnapshot:
        switches = [SwitchSnapshot.from_json(s) for s in self.switches.snapshot()]
        return EngineSnapshot(model=self.model_name, switches=switches,
                              mtp=MtpSnapshot(draft_proposed=[10, 8], draft_accepted=[7, 3]),
                              vram=[VramEvent(device="cuda:0", weights_mib=100.0, kv_mib=50.0,
                                              reserve_mib=float(self.vram_reserve_mib or 0))])

    async def set_switch(self, name: str, enabled: bool) -> SwitchState:
        state = self.switches.set_live(name, enabled)
        self.bus.publish(SwitchEvent(name=state.name, state="on" if enabled else "off", reason="api"))
        return state

    async def set_vram_reserve(self, mib: int) -> int:
        self.vram_reserve_mib = mib
        return mib

    async def set_expert_cache_mib(self, mib: int) -> ExpertCacheSnapshot:
        raise NoExpertCache(f"the model {self.model_name} has no MoE layers: there is no expert cache to resize")

    async def shutdown(self, wait_s: float | None = None) -> None:
        self.ready = False
