"""Request and response schemas of the HTTP API (OpenAI-compatible /v1, Strata control routes).

Pydantic models only: what a body may contain and how each field is bounded. What the server does with a
valid request lives in `serving.py`; which parameters the engine cannot honour (n > 1, logprobs, ...) is
decided there too, so every refusal names its parameter the same way.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictBool,
                      StrictInt, StringConstraints, ValidationError, model_serializer)

from engine.option_checks import EXPERT_CACHE_MAX_MIB, VRAM_RESERVE_MAX_MIB
from engine.errors import PromptTooLong
from engine.server import json_chunked
from engine.server.errors import ApiError, from_exception, from_validation_error, invalid_param, malformed_json
from engine.server.json_chunked import Steps

# One rule for every integer the server reads from text (a logit_bias key, a Last-Event-ID): ASCII digits
# only and at most MAX_DECIMAL_DIGITS of them. Python's int() also takes "²" or "①" (and raises on some)
# and refuses more than 4300 digits with a ValueError: neither may reach it.
MAX_DECIMAL_DIGITS = 19  # every value below 10**19 fits an int64
DECIMAL_PATTERN = rf"^[0-9]{{1,{MAX_DECIMAL_DIGITS}}}$"
INT64_MAX = (1 << 63) - 1  # the bound of every JSON integer field that has no smaller one of its own

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
MAX_STOP_STRINGS = 4
# torch.Generator.manual_seed takes -2**63 .. 2**64 - 1; anything outside is refused here, naming `seed`.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


MIN_ARRAY_LIMIT = 1 << 16  # arrays in a large body are cut off past max(context, this)
LARGE_BODY_BYTES = 256 << 10  # above this a body is parsed in pieces (json_chunked): the event loop keeps going
# refuse_early_steps looks after this many bytes per id of a limit: ids of up to six digits with a comma and a space
# (a tokenizer's ids, as JSON writers space them); a body whose ids are longer is parsed whole, as before
PROBE_BYTES_PER_ID = 8
ID_CHECK_PIECE = 1 << 14  # a token-id prompt longer than this is checked this many ids per step
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default limit; OpenAI's is 20 for chat)
MAX_CHOICES = 16  # n: each choice is one engine request
MAX_LOGIT_BIAS = 300  # entries, as OpenAI


class _Body(BaseModel):
    # Unknown fields are refused by name: a field this server does not know may change results (vLLM's
    # min_tokens, guided_json, ...), and answering as if it had been honoured would be a silent lie. Fields
    # that cannot change results are declared in IGNORED and accepted. Strict: `true` is not an integer
    # and "1" is not a boolean (OpenAI refuses both too).
    model_config = ConfigDict(extra="forbid", strict=True)


def _only_true(value: bool) -> bool:
    if value is not True:
        raise ValueError("only true is supported (special tokens are always skipped in the output text)")
    return value


def decimal(text: str) -> int | None:
    """The integer `text` spells by the one rule above (DECIMAL_PATTERN), else None."""
    if not 0 < len(text) <= MAX_DECIMAL_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


class _Ignored(_Body):
    """Accepted and ignored: they cannot change what is generated (listed in docs/API.md)."""

    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None  # only meaningful with tools, which are refused
    # What this server does anyway; false is refused (and so is 1: a bool is not an integer here).
    skip_special_tokens: Annotated[StrictBool, AfterValidator(_only_true)] | None = None


IGNORED = tuple(_Ignored.model_fields)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Ignored):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: Annotated[dict[Annotated[str, StringConstraints(pattern=DECIMAL_PATTERN)],
                               Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's sampling extensions.
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None  # -1 or 0: off; >= the vocabulary: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    # vLLM-style extensions: benchmarks need exact output lengths, chat formats need extra stop tokens.
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids (one prompt; a batch of several is refused)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    suffix: str | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    # vLLM's extension (>= 0.10.2): each choice carries its generated ids and the prompt's. A load client counts
    # tokens by them: a token whose text is empty (an id the tokenizer does not know) is otherwise invisible.
    return_token_ids: bool = False


class ContentPart(_Body):
    model_config = ConfigDict(extra="ignore", strict=True)  # image_url & co: refused by `type` (chat.py)
    type: str
    text: str | None = None


class ChatMessage(_Body):
    # A message copied from a response carries refusal/annotations/audio/tool_calls as nulls: those are
    # fine; chat.py refuses any extra field that holds something, naming it.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class SwitchRequest(BaseModel):
    """POST /strata/switches/{NAME}."""

    model_config = ConfigDict(extra="forbid")
    enabled: StrictBool


class VramReserveRequest(BaseModel):
    """POST /strata/vram-reserve."""

    model_config = ConfigDict(extra="forbid")
    mib: Annotated[StrictInt, Field(ge=0, le=VRAM_RESERVE_MAX_MIB)]


class ExpertCacheRequest(BaseModel):
    """POST /strata/expert-cache."""

    model_config = ConfigDict(extra="forbid")
    mib: Annotated[StrictInt, Field(ge=1, le=EXPERT_CACHE_MAX_MIB)]


# --- responses ---------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None  # {tokens, token_logprobs, top_logprobs, text_offset}
    finish_reason: str | None = None
    # With return_token_ids only; without it the keys are absent, so the response is OpenAI's to the byte.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _ids_only_when_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.token_ids is None:
            data.pop("prompt_token_ids", None)
            data.pop("token_ids", None)
        return data


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None  # {content: [{token, logprob, bytes, top_logprobs}]}
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "strata"
    max_model_len: int
    vocab_size: int | None = None  # token-id prompts must stay below it (the load scenarios read it)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- parsing -----------------------------------------------------------------------------------------------

BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(model: type[BodyT], raw: bytes, max_prompt_ids: int | None = None) -> BodyT:
    """Parse a JSON body into `model`; malformed JSON and invalid fields raise ApiError (400).

    `max_prompt_ids` (the context) refuses a token-id prompt that cannot fit before the validator walks it.
    The routes run a small body in a worker thread and a large one as `parse_body_steps` on the event loop."""
    return json_chunked.finish(parse_body_steps(model, raw, max_prompt_ids))


def parse_body_steps(model: type[BodyT], raw: bytes, max_prompt_ids: int | None = None) -> Steps[BodyT]:
    """`parse_body` as steps (json_chunked.Steps): a large body is parsed, and a long token-id prompt
    checked, a piece per step, so the event loop can drive it and answer other requests between pieces."""
    try:
        if len(raw) > LARGE_BODY_BYTES:
            # No array a request may hold (a prompt, messages, stop ids) can outgrow the context: stop there.
            limit = None if max_prompt_ids is None else max(max_prompt_ids, MIN_ARRAY_LIMIT)
            data = yield from json_chunked.loads_steps(raw, limit)
        else:
            data = json.loads(raw)
    except json_chunked.TooManyItems as exc:
        raise _array_too_long(exc, max_prompt_ids) from None
    except RecursionError:
        raise malformed_json("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise malformed_json(str(exc)) from None
    if not isinstance(data, dict):
        raise malformed_json(f"expected a JSON object, got {type(data).__name__}")
    if not raw.isascii() or b"\\u" in raw:  # else no string can hold a surrogate: a big body skips the walk
        _check_unicode(data)
    prompt = data.get("prompt")
    nested = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list)
    if nested:
        prompt = prompt[0]  # [[ids]]: one prompt of ids
    if max_prompt_ids is not None and isinstance(prompt, list) and len(prompt) > max_prompt_ids:
        if all(type(t) is int for t in prompt[:16]):  # ids, not a batch of prompts (refused by name later)
            raise from_exception(PromptTooLong(len(prompt), max_prompt_ids))
    ids = prompt if "prompt" in model.model_fields and isinstance(prompt, list) else None
    if ids is None or len(ids) <= ID_CHECK_PIECE or not (yield from _token_ids(ids)):
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
    # Every id is one TokenId allows: the validator would only copy the list, in one call as long as the
    # list is. It validates the rest of the body around an empty prompt of the same shape instead.
    try:
        body = model.model_validate({**data, "prompt": [[]] if nested else []})
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    body.prompt = [ids] if nested else ids  # type: ignore[attr-defined]
    return body


def _token_ids(items: list) -> Steps[bool]:
    """Whether every item is an int TokenId allows (bool is not one), checked ID_CHECK_PIECE items a step."""
    for start in range(0, len(items), ID_CHECK_PIECE):
        piece = items[start:start + ID_CHECK_PIECE]
        if set(map(type, piece)) != {int} or min(piece) < 0 or max(piece) > INT64_MAX:
            return False
        yield
    return True


def probe_bytes(max_prompt_ids: int | None) -> tuple[int, ...]:
    """After how many bytes of a large body `refuse_early_steps` looks at what is in (none: no context to hold
    arrays to): once a prompt of ids past the context could be in, and once any array past the arrays' limit."""
    if max_prompt_ids is None:
        return ()
    return tuple(sorted({(max_prompt_ids + 1) * PROBE_BYTES_PER_ID,
                         max(max_prompt_ids, MIN_ARRAY_LIMIT) * PROBE_BYTES_PER_ID}))


def refuse_early_steps(prefix: bytes, max_prompt_ids: int) -> Steps[str | None]:
    """The 400 for a prompt longer than the context, or an array past the limit parse_body holds every array
    to, when the first bytes of the body already hold one; nothing otherwise (a body cut short is no error
    yet: the whole body is parsed when it is in). So a body that cannot fit is refused before the rest of it
    is read, and after parsing no more of it than the context's worth of ids. A text prompt that the prefix
    ends inside is returned (what of it is in), for its tokens to be counted before the rest is read.
    Steps, as `parse_body_steps`."""
    limit = max(max_prompt_ids, MIN_ARRAY_LIMIT)
    try:
        yield from json_chunked.loads_steps(_whole_utf8(prefix), limit, {"prompt": max_prompt_ids},
                                            frozenset({"prompt"}))
    except json_chunked.UnendedText as exc:
        return exc.head or None
    except json_chunked.TooManyItems as exc:
        if exc.member == "prompt":
            raise ApiError(400, f"prompt holds more than {exc.max_items} items; this engine's context is "
                                f"{max_prompt_ids} tokens", param="prompt", code="context_length_exceeded") from None
        raise _array_too_long(exc, max_prompt_ids) from None
    except (ValueError, RecursionError):
        return None
    return None


def _whole_utf8(prefix: bytes) -> bytes:
    """`prefix` without the UTF-8 character its end cuts into: a socket read ends anywhere, and a prefix that ends
    inside a character does not decode (the probe then learnt nothing from a text of megabytes)."""
    for back in range(1, min(4, len(prefix)) + 1):
        lead = prefix[-back]
        if lead & 0xC0 != 0x80:  # the last character's first byte: how many bytes it takes
            length = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
            return prefix[:-back] if length > back else prefix
    return prefix


def _array_too_long(exc: json_chunked.TooManyItems, max_prompt_ids: int | None) -> ApiError:
    return ApiError(400, f"{exc}; no prompt, message list or token-id list can be longer than the context "
                         f"({max_prompt_ids} tokens)", code="context_length_exceeded")


def _check_unicode(data: Any) -> None:
    """400 naming the field when a string holds a lone surrogate (`"\\ud800"` is valid JSON but no text:
    a tokenizer cannot encode it). One C-speed pass; the field is looked for only when it fails."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        path, value = _find_surrogate(data, "")
        raise invalid_param(path or "body", value, "a lone UTF-16 surrogate is not valid Unicode text") from None


def _find_surrogate(node: Any, path: str) -> tuple[str, str]:
    stack = [(node, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where, item
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
            stack.extend((k, where or "body") for k in item if isinstance(k, str))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return "", ""
