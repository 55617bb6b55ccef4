"""A small in-process stand-in for `strata-engine serve`'s OpenAI routes, for the scenario runner's tests.

It is the runner's *dependency*, not the thing under test: it streams completions at a fixed token interval,
slows every decoding request while a long prompt is "prefilling" (as a real engine shares its steps), keeps a
prefix cache of earlier prompts so a repeat reports cached tokens, rejects prompts past its context, and can
die mid-scenario (dropping connections, answering 503) like the engine in the seed report. Asked for vLLM's
`return_token_ids`, it sends each token's id and leaves every other token's text empty, as a random checkpoint
whose vocabulary is larger than its tokenizer's; it can also play a generic OpenAI server (no /strata/state) or
a Strata server from before that field (it refuses the field by name). Given `eos_after_tokens`, its "model" ends
every generation with EOS (finish_reason "stop") after that many tokens unless the request sets vLLM's
`ignore_eos`, a field a server made with `knows_ignore_eos=False` refuses by name.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

CACHE_BLOCK_TOKENS = 16


class FakeOpenAIServer:
    """Serves /health, /v1/models, /strata/state and streamed /v1/completions through httpx.MockTransport."""

    def __init__(self, vocab_size: int = 1000, context_tokens: int = 100_000, token_interval_s: float = 0.004,
                 prefill_s_per_1k_tokens: float = 0.05, long_prompt_tokens: int = 1000, slowdown: float = 3.0,
                 die_on_long: bool = False, api_key: str | None = None, models_has_vocab: bool = True,
                 state_has_vocab: bool = True, slots: int | None = None, has_state: bool = True,
                 knows_token_ids: bool = True, eos_after_tokens: int | None = None,
                 knows_ignore_eos: bool = True) -> None:
        self.vocab_size = vocab_size
        self.slots = slots  # reported as config.batch when set (the fake itself runs any number at once)
        self.context_tokens = context_tokens
        self.token_interval_s = token_interval_s
        self.prefill_s_per_1k_tokens = prefill_s_per_1k_tokens
        self.long_prompt_tokens = long_prompt_tokens
        self.slowdown = slowdown
        self.die_on_long = die_on_long
        self.api_key = api_key
        self.models_has_vocab = models_has_vocab
        self.state_has_vocab = state_has_vocab
        self.has_state = has_state
        self.knows_token_ids = knows_token_ids
        self.eos_after_tokens = eos_after_tokens
        self.knows_ignore_eos = knows_ignore_eos
        self.accept_ids_below = vocab_size  # a test may make it disagree with the advertised vocab
        self.prefilling = 0
        self.dead_reason: str | None = None
        self.seen_prompts: list[list[int]] = []
        self.bodies: list[dict[str, Any]] = []
        self.auth_headers: list[str | None] = []

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle), base_url="http://fake")

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            if self.dead_reason:
                return httpx.Response(503, json={"status": "dead", "reason": f"dead: {self.dead_reason}"})
            return httpx.Response(200, json={"status": "ready", "reason": "ready"})
        self.auth_headers.append(request.headers.get("authorization"))
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": {"message": "invalid api key", "type": "auth"}})
        if path == "/v1/models":
            card: dict[str, Any] = {"id": "fake-model", "object": "model"}
            if self.models_has_vocab:
                card["vocab_size"] = self.vocab_size
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if path == "/strata/state" and self.has_state:
            model = {"vocab_size": self.vocab_size} if self.state_has_vocab else {}
            config = {"context": self.context_tokens} | ({"batch": self.slots} if self.slots else {})
            return httpx.Response(200, json={"config": config, "model": model})
        if path == "/v1/completions":
            return self._complete(json.loads(request.content))
        return httpx.Response(404, json={"detail": "not found"})

    def _complete(self, body: dict[str, Any]) -> httpx.Response:
        self.bodies.append(body)
        if "return_token_ids" in body and not self.knows_token_ids:
            return httpx.Response(400, json={"error": {"message": "return_token_ids: unknown field",
                                                       "param": "return_token_ids", "code": "unknown_parameter"}})
        if "ignore_eos" in body and not self.knows_ignore_eos:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                                                       "param": "ignore_eos", "code": "unknown_parameter"}})
        prompt = body["prompt"]
        max_tokens = int(body["max_tokens"])
        if not all(isinstance(t, int) and 0 <= t < self.accept_ids_below for t in prompt):
            return httpx.Response(400, json={"error": {"message": "prompt token id out of range", "param": "prompt"}})
        if len(prompt) + max_tokens > self.context_tokens:
            msg = f"prompt is {len(prompt)} tokens; this engine's context is {self.context_tokens} tokens"
            return httpx.Response(400, json={"error": {"message": msg, "code": "context_length_exceeded"}})
        cached = self._cached_tokens(prompt)
        self.seen_prompts.append(list(prompt))
        if self.eos_after_tokens is not None and not body.get("ignore_eos"):
            max_tokens = min(max_tokens, self.eos_after_tokens)
            finish_at_end = "stop"
        else:
            finish_at_end = "length"
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._stream(len(prompt), cached, max_tokens,
                                                   bool(body.get("return_token_ids")), finish_at_end))

    def _cached_tokens(self, prompt: list[int]) -> int:
        best = 0
        for old in self.seen_prompts:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            best = max(best, n - n % CACHE_BLOCK_TOKENS)
        return best

    async def _stream(self, prompt_tokens: int, cached: int, max_tokens: int, token_ids: bool, finish_at_end: str):
        fresh_tokens = prompt_tokens - cached
        if prompt_tokens >= self.long_prompt_tokens:
            if self.die_on_long:
                self.dead_reason = "CUDA error: out of memory"
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            self.prefilling += 1
            try:
                await asyncio.sleep(fresh_tokens / 1000 * self.prefill_s_per_1k_tokens)
            finally:
                self.prefilling -= 1
        for i in range(max_tokens):
            await asyncio.sleep(self.token_interval_s * (self.slowdown if self.prefilling else 1.0))
            if self.dead_reason:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            finish = finish_at_end if i == max_tokens - 1 else None
            choice: dict[str, Any] = {"index": 0, "text": f" t{i}", "finish_reason": finish}
            if token_ids:
                choice["token_ids"] = [i]
                if i % 2:
                    choice["text"] = ""  # an id its tokenizer does not know
            yield _sse({"object": "text_completion", "choices": [choice]})
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        yield _sse({"object": "text_completion", "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


class AsgiAdapter:
    """Serves a FakeOpenAIServer over real HTTP (uvicorn), so the CLI can be tested against a socket."""

    def __init__(self, server: FakeOpenAIServer) -> None:
        self.server = server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        request = httpx.Request(scope["method"], f"http://fake{scope['path']}", headers=headers, content=body)
        response = await self.server.handle(request)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()
                                if k.lower() != "content-length"]})
        try:
            async for chunk in response.stream:  # type: ignore[union-attr]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.RemoteProtocolError:
            return  # the fake engine "died": drop the connection without finishing the body
        await send({"type": "http.response.body", "body": b"", "more_body": False})
