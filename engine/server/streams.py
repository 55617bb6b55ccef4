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
from engine.server.logprobs import CompletionLogprobs, chat_logprobs
from engine.server.protocol import Usage
from engine.server.sse import DONE, sse_data


Choices = AsyncIterator[tuple[int, RequestOutput]]  # (choice index, an output of that choice), merged


async def completion_chunks(client: EngineClient, outputs: Choices, request_id: str, include_usage: bool,
                            prompt_tokens: int, logprobs_top: int | None = None,
                            return_ids_of_prompt: list[int] | None = None) -> AsyncIterator[str]:
    """`text_completion` chunks, one choice per chunk (its `index` says which).

    `return_ids_of_prompt` (vLLM's return_token_ids, given the prompt's ids): every chunk carries `token_ids`,
    the ids new in it, and a chunk goes out for every new id even when its text is empty; the first chunk of
    each choice carries `prompt_token_ids` (null on the later ones, as vLLM)."""
    created = int(time.time())
    model = client.model_name
    formatters: dict[int, CompletionLogprobs] = {}
    prompt_sent: set[int] = set()

    def chunk(index: int, out: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if logprobs_top is not None and out.logprobs is not None:
            logprobs = formatters.setdefault(index, CompletionLogprobs(client.decode, logprobs_top)).part(out.logprobs)
        choice: dict[str, Any] = {"index": index, "text": out.text, "logprobs": logprobs,
                                  "finish_reason": out.finish_reason}
        if return_ids_of_prompt is not None:
            choice["prompt_token_ids"] = None if index in prompt_sent else return_ids_of_prompt
            choice["token_ids"] = list(out.token_ids)
            prompt_sent.add(index)
        body: dict[str, Any] = {
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return body

    async for piece in _framed(client, outputs, include_usage, prompt_tokens, request_id, created,
                               "text_completion", chunk, send_ids=return_ids_of_prompt is not None):
        yield piece


async def chat_chunks(client: EngineClient, outputs: Choices, request_id: str, include_usage: bool,
                      prompt_tokens: int, logprobs_top: int | None = None) -> AsyncIterator[str]:
    """`chat.completion.chunk` chunks: each choice's first carries the role, its last the finish reason."""
    created = int(time.time())
    model = client.model_name
    sent_role: set[int] = set()

    def chunk(index: int, out: RequestOutput) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if index not in sent_role:
            delta["role"] = "assistant"
            sent_role.add(index)
        if out.text or not out.finished:
            delta["content"] = out.text
        logprobs = None
        if logprobs_top is not None and out.logprobs is not None:
            logprobs = chat_logprobs(client.decode, out.logprobs, logprobs_top)
        body: dict[str, Any] = {
            "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return body

    async for piece in _framed(client, outputs, include_usage, prompt_tokens, request_id, created,
                               "chat.completion.chunk", chunk):
        yield piece


async def _framed(client: EngineClient, outputs: Choices, include_usage: bool, prompt_tokens: int,
                  request_id: str, created: int, obj: str, make_chunk: Any, send_ids: bool = False
                  ) -> AsyncIterator[str]:
    """SSE framing shared by both formats. An output goes out when it has text, logprobs or the finish; with
    `send_ids` also when it only has new token ids (their text may be empty, or held back mid-character)."""
    last: dict[int, RequestOutput] = {}
    try:
        async for index, out in outputs:
            last[index] = out
            if out.finished and out.finish_reason == "error":
                yield sse_data(generation_error(client, out).body())
                break
            if out.text or out.finished or out.logprobs or (send_ids and out.token_ids):
                yield sse_data(make_chunk(index, out))
    except ClientGone:
        return
    except Exception as exc:  # after the headers: report in-band, then end the stream cleanly
        yield sse_data(from_exception(exc).body())
    if include_usage:
        yield sse_data({"id": request_id, "object": obj, "created": created, "model": client.model_name,
                        "choices": [],
                        "usage": usage_of_choices(list(last.values()), prompt_tokens).model_dump()})
    yield DONE


def generation_error(client: EngineClient, out: RequestOutput) -> ApiError:
    """The error for a request the engine ended with finish_reason "error": 503 with the reason when the
    engine died of it (a sticky CUDA error ends every running request), else 500 with the message."""
    health = client.health()
    if health.dead:
        return from_exception(EngineDead(health.reason.partition(":")[2].strip() or health.reason))
    return ApiError(500, f"generation failed: {out.error or 'unknown error'}", type="server_error")


def usage_of_choices(lasts: list[RequestOutput], prompt_tokens: int) -> Usage:
    """Usage of n choices of one prompt: the prompt counted once, the completions summed (OpenAI's rule)."""
    if not lasts:
        return Usage.of(prompt_tokens, 0, 0)
    first = lasts[0]
    return Usage.of(first.prompt_tokens or prompt_tokens, sum(o.completion_tokens for o in lasts),
                    first.cached_tokens)

