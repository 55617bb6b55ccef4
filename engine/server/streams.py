"""The OpenAI streaming formats: engine outputs in, SSE `data:` chunks out, ending with `data: [DONE]`.

Errors that arrive after the headers were sent (the engine died mid-stream) cannot change the status code,
so they go out as one `data: {"error": {...}}` chunk before `[DONE]`, as OpenAI's own server does.
A client that disconnected gets nothing more: the stream just ends.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from engine.api import EngineClient, RequestOutput
from engine.errors import EngineDead
from engine.server.errors import ApiError, from_exception
from engine.server.handle import ClientGone
from engine.server.protocol import Usage
from engine.server.sse import DONE, sse_data


async def completion_chunks(client: EngineClient, outputs: AsyncIterator[RequestOutput], request_id: str,
                            include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """`text_completion` chunks."""
    created = int(time.time())
    model = client.model_name

    def chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return body

    async for piece in _framed(client, outputs, include_usage, prompt_tokens, request_id, created,
                               "text_completion", lambda out: chunk(out.text, out.finish_reason)):
        yield piece


async def chat_chunks(client: EngineClient, outputs: AsyncIterator[RequestOutput], request_id: str,
                      include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """`chat.completion.chunk` chunks: the first carries the role, the last the finish reason."""
    created = int(time.time())
    model = client.model_name
    sent_role = False

    def chunk(out: RequestOutput) -> dict[str, Any]:
        nonlocal sent_role
        delta: dict[str, Any] = {}
        if not sent_role:
            delta["role"] = "assistant"
            sent_role = True
        if out.text or not out.finished:
            delta["content"] = out.text
        body: dict[str, Any] = {
            "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return body

    async for piece in _framed(client, outputs, include_usage, prompt_tokens, request_id, created,
                               "chat.completion.chunk", chunk):
        yield piece


async def _framed(client: EngineClient, outputs: AsyncIterator[RequestOutput], include_usage: bool,
                  prompt_tokens: int, request_id: str, created: int, obj: str, make_chunk: Any
                  ) -> AsyncIterator[str]:
    last: RequestOutput | None = None
    try:
        async for out in outputs:
            last = out
            if out.finished and out.finish_reason == "error":
                yield sse_data(generation_error(client, out).body())
                break
            if out.text or out.finished:
                yield sse_data(make_chunk(out))
    except ClientGone:
        return
    except Exception as exc:  # after the headers: report in-band, then end the stream cleanly
        yield sse_data(from_exception(exc).body())
    if include_usage:
        yield sse_data({"id": request_id, "object": obj, "created": created, "model": client.model_name,
                        "choices": [],
                        "usage": usage_of(last, prompt_tokens).model_dump()})
    yield DONE


def generation_error(client: EngineClient, out: RequestOutput) -> ApiError:
    """The error for a request the engine ended with finish_reason "error": 503 with the reason when the
    engine died of it (a sticky CUDA error ends every running request), else 500 with the message."""
    health = client.health()
    if health.dead:
        return from_exception(EngineDead(health.reason.partition(":")[2].strip() or health.reason))
    return ApiError(500, f"generation failed: {out.error or 'unknown error'}", type="server_error")


def usage_of(last: RequestOutput | None, prompt_tokens: int) -> Usage:
    """Usage from the last output's cumulative counts (the prompt length we sent when the engine gave 0)."""
    if last is None:
        return Usage.of(prompt_tokens, 0, 0)
    return Usage.of(last.prompt_tokens or prompt_tokens, last.completion_tokens, last.cached_tokens)
