"""The HTTP side of the load scenarios: discover the server, stream one completion, time it. Torch-free.

Kept apart from `engine/loadgen/scenarios.py` (which says *what* to send) so the request timing can be read on its
own. Every failure of a request (an HTTP error, a connection the engine dropped by dying) is recorded in its
RequestResult rather than raised: a scenario's purpose is to show what the engine did under load.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from engine.errors import ConfigError

_VOCAB_KEYS = ("vocab_size", "n_vocab")  # Strata's and vLLM's, then llama.cpp's (/v1/models "meta")
FALLBACK_VOCAB_SIZE = 256
# vLLM's extensions to the OpenAI body that the load client may send; a server without one refuses it by name
_OPTIONAL_FIELDS = ("return_token_ids", "ignore_eos")
_CONTEXT_KEYS = ("context_tokens", "max_model_len", "context", "n_ctx")  # n_ctx: a llama.cpp slot's (/props)
_SLOTS_KEYS = ("max_num_seqs", "batch", "slots", "total_slots")  # vLLM's, Strata's config and books, llama.cpp's
# A server's answers are read to a limit and no further: a server that answers /v1/models with tens of MB, or
# streams a line that never ends, must not take the client's memory with it.
MAX_ANSWER_BYTES = 4 << 20  # /v1/models, /strata/state, /props, /health, an error body
MAX_LINE_CHARS = 1 << 20  # one line of a streamed completion (a chunk is a few hundred bytes)


class AnswerTooLarge(ValueError):
    """A body or stream line past its limit: not read further."""


@dataclass
class RequestResult:
    """One request's timing and counts. Times are seconds since the scenario started."""

    label: str
    kind: str  # short | long
    prompt_tokens: int
    max_tokens: int
    start_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # (time, tokens) per streamed increment; one increment may carry several tokens when MTP drafts land
    increments: list[tuple[float, int]] = field(default_factory=list, repr=False)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first token."""
        if self.first_token_s is None or self.end_s is None or self.completion_tokens < 2:
            return None
        span_s = self.end_s - self.first_token_s
        return (self.completion_tokens - 1) / span_s if span_s > 0 else None

    def summary(self) -> str:
        ttft = f"{self.ttft_s:.2f} s" if self.ttft_s is not None else "-"
        rate = f"{self.decode_tok_s:.1f} tok/s" if self.decode_tok_s is not None else "-"
        return (f"{self.completion_tokens} tokens, ttft {ttft}, decode {rate}, cached {self.cached_tokens}, "
                f"finish {self.finish_reason}")

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "start_s": round(self.start_s, 4),
            "ttft_s": _round(self.ttft_s),
            "end_s": _round(self.end_s),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "decode_tok_s": _round(self.decode_tok_s),
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(frozen=True)
class ServerInfo:
    """What a scenario needs to know about the server before it sends anything."""

    model: str
    vocab_size: int
    context_tokens: int | None
    health: str
    notes: tuple[str, ...] = ()
    slots: int | None = None  # requests the server runs at once (None: it does not say)


class LoadClient:
    """A thin async client over one server's OpenAI routes, with the auth header applied."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.headers = headers
        self.model = ""
        # Ask for vLLM's `return_token_ids` (set by `discover` for a Strata server): chunks then carry their
        # tokens' ids, and a token whose text is empty (a random checkpoint's vocabulary is far larger than its
        # tokenizer's) still arrives and is counted. A generic OpenAI server would refuse the unknown field.
        self.return_token_ids = False
        # vLLM's body fields this server refused by name (each is asked once, then left out)
        self.refused_fields: set[str] = set()

    async def get_json(self, path: str) -> tuple[int, Any]:
        """(status, the body's JSON, else its text; a body past MAX_ANSWER_BYTES: what it was, in words)."""
        async with self.client.stream("GET", self.base_url + path, headers=self.headers) as resp:
            try:
                text = await _read_text(resp, path)
            except AnswerTooLarge as exc:
                return resp.status_code, str(exc)
        try:
            return resp.status_code, json.loads(text)
        except ValueError:
            return resp.status_code, text

    async def health(self) -> str:
        """`"200 ready"`-style status of /health, or the connection error when the server is gone."""
        try:
            async with self.client.stream("GET", self.base_url + "/health", timeout=10.0) as resp:
                try:
                    text = await _read_text(resp, "/health")
                except AnswerTooLarge as exc:
                    text = str(exc)
        except httpx.HTTPError as exc:
            return f"unreachable: {_describe(exc)}"
        return f"{resp.status_code} {_body_reason(text)}".strip()

    async def complete(self, result: RequestResult, prompt_ids: list[int], max_tokens: int, temperature: float,
                       t0: float, on_first_token: Callable[[], Awaitable[None]] | None = None,
                       ignore_eos: bool = False) -> None:
        """Stream one /v1/completions request and fill `result`; never raises for server-side failures.

        `ignore_eos` asks (vLLM's field) for generation to go on past EOS: a request that must decode until the
        client stops it would otherwise end whenever the model says EOS, which a random checkpoint may do at its
        first token.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        wanted = {"return_token_ids": self.return_token_ids, "ignore_eos": ignore_eos}
        body.update({field: True for field, on in wanted.items() if on and field not in self.refused_fields})
        try:
            while (refused := await self._stream(body, result, t0, on_first_token)) is not None:
                # A server without the field (a generic OpenAI one, a Strata server from before it) refused it
                # by name: ask again without it, and leave it out from now on (this one request's TTFT includes
                # the refused round trip; without token ids, text chunks are counted as from any OpenAI server).
                self.refused_fields.add(refused)
                del body[refused]
        except httpx.HTTPError as exc:
            result.error = _describe(exc)
        finally:
            result.end_s = time.perf_counter() - t0
        if result.error is None and result.finish_reason is None:
            result.error = "stream ended without a finish_reason (the server closed it early)"

    async def _stream(self, body: dict[str, Any], result: RequestResult, t0: float,
                      on_first_token: Callable[[], Awaitable[None]] | None) -> str | None:
        """POST one streamed completion and apply its lines to `result`. The name of an optional field, with
        nothing recorded, when the server refused that field by name."""
        async with self.client.stream("POST", self.base_url + "/v1/completions", json=body,
                                      headers=self.headers) as resp:
            if resp.status_code != 200:
                try:
                    text = await _read_text(resp, "/v1/completions")
                except AnswerTooLarge as exc:
                    text = str(exc)
                refused = _refused_field(resp.status_code, text, [f for f in _OPTIONAL_FIELDS if f in body])
                if refused is not None:
                    return refused
                result.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                return None
            try:
                async for line in _lines(resp):
                    if await self._on_line(result, line, t0) and on_first_token is not None:
                        await on_first_token()
            except AnswerTooLarge as exc:
                result.error = str(exc)
        return None

    async def _on_line(self, result: RequestResult, line: str, t0: float) -> bool:
        """Apply one SSE line; True when it carried the request's first token."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if not data or data == "[DONE]":
            return False
        try:
            chunk = json.loads(data)
        except ValueError:
            result.error = f"unparseable stream chunk: {data[:120]!r}"
            return False
        if "error" in chunk:
            result.error = f"stream error: {_error_message(json.dumps(chunk))}"
            return False
        now_s = time.perf_counter() - t0
        first = False
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            # With token ids the count is exact (empty text included); without, a text chunk is one token
            # until the usage total rescales them.
            n_tokens = len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
            if n_tokens:
                first = result.first_token_s is None
                if first:
                    result.first_token_s = now_s
                result.increments.append((now_s, n_tokens))
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0)
            _rescale_increments(result)
        return first


async def _read_text(resp: httpx.Response, path: str) -> str:
    """A streamed response's body as text, read to MAX_ANSWER_BYTES at most (AnswerTooLarge past it)."""
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise AnswerTooLarge(f"{path} answered over {MAX_ANSWER_BYTES >> 20} MiB: not read")
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


_LINE_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # str.splitlines' (and so httpx's aiter_lines')


async def _lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, as `aiter_lines` splits them (which holds a line that never ends whole):
    AnswerTooLarge when a line passes MAX_LINE_CHARS without ending."""
    rest = ""
    async for text in resp.aiter_text():
        text = rest + text
        lines = text.splitlines()
        rest = lines.pop() if lines and text[-1] not in _LINE_ENDS else ""
        if len(rest) > MAX_LINE_CHARS:
            raise AnswerTooLarge(f"the stream sent a line past {MAX_LINE_CHARS:,} characters without ending it")
        for line in lines:
            yield line
    if rest:
        yield rest


def _refused_field(status: int, text: str, optional: list[str]) -> str | None:
    """Which of the body's `optional` fields a 400 refuses: the one it names as its `param` (vLLM, Strata), or
    the one its message names (OpenAI's own "Unrecognized request argument supplied: ..." has no param)."""
    if status != 400 or not optional:
        return None
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(err, dict):
        return None
    if err.get("param") in optional:
        return str(err["param"])
    named = [f for f in optional if f in str(err.get("message", ""))]
    return named[0] if len(named) == 1 else None


def _rescale_increments(result: RequestResult) -> None:
    """Make per-increment counts sum to usage.completion_tokens when the chunks did not carry token ids.

    A server that sends no token ids may fold several MTP-accepted tokens into one text chunk; spreading the
    usage total over the increments keeps windowed rates honest. With token ids the counts already match.
    """
    counted = sum(n for _, n in result.increments)
    if not result.increments or counted == result.completion_tokens or result.completion_tokens <= 0:
        return
    scale = result.completion_tokens / counted
    result.increments = [(t, n * scale) for t, n in result.increments]  # type: ignore[misc]


async def discover(load: LoadClient) -> ServerInfo:
    """Model id, vocab size, context per slot and slot count from /v1/models and /strata/state; health from
    /health.

    Raises ConfigError naming the URL when the server cannot be reached or /v1/models fails. Without a
    reported vocab size, prompts fall back to ids below 256 (with a note in the result).
    """
    try:
        health = await load.health()
        status, models = await load.get_json("/v1/models")
    except httpx.HTTPError as exc:  # pragma: no cover - health() already caught transport errors
        raise ConfigError("url", load.base_url, f"server unreachable: {_describe(exc)}") from None
    if health.startswith("unreachable"):
        raise ConfigError("url", load.base_url, f"server {health}")
    if status != 200 or not isinstance(models, dict) or not models.get("data"):
        detail = _error_message(json.dumps(models)) if isinstance(models, dict) else str(models)[:200]
        raise ConfigError("url", load.base_url, f"GET /v1/models answered {status}: {detail}")
    card = models["data"][0]
    load.model = str(card.get("id", ""))
    found = [card]
    try:
        state_status, state = await load.get_json("/strata/state")
        if state_status == 200:
            found.append(state)
            load.return_token_ids = True  # a Strata server: it knows the field
        else:  # llama.cpp's /props says a slot's context and the slot count
            props_status, props = await load.get_json("/props")
            if props_status == 200 and isinstance(props, dict):
                found.append(props)
    except httpx.HTTPError:
        pass  # the state route is a bonus: /v1/models may already say everything
    vocab = _find_number(found, _VOCAB_KEYS)
    notes: tuple[str, ...] = ()
    if vocab is None or vocab < 2:
        # Every tokenizer we serve has at least the 256 byte tokens, so ids below that are always valid.
        vocab = FALLBACK_VOCAB_SIZE
        notes = (f"neither /v1/models nor /strata/state reports a vocab_size: prompts use ids below "
                 f"{FALLBACK_VOCAB_SIZE}",)
    return ServerInfo(load.model, int(vocab), _find_number(found, _CONTEXT_KEYS), health, notes,
                      slots=_find_number(found, _SLOTS_KEYS))


def _find_number(documents: list[Any], keys: tuple[str, ...]) -> int | None:
    """The first whole number stored under one of `keys` (in key order), searching nested JSON breadth-first."""
    for key in keys:
        queue = list(documents)
        while queue:
            node = queue.pop(0)
            if isinstance(node, dict):
                value = node.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
                queue.extend(node.values())
            elif isinstance(node, list):
                queue.extend(node)
    return None


def _describe(exc: BaseException) -> str:
    """Exception type and message; httpx transport errors often have an empty message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:300]
    return text.strip()[:300]


def _body_reason(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:200]
    if isinstance(data, dict):
        for key in ("reason", "status", "detail"):
            if key in data:
                return str(data[key])[:200]
    return text.strip()[:200]
