"""The OpenAI parameters checked on their own, before a request is prepared (engine.server.serving): what this
engine refuses, each naming its parameter, and the parameters whose OpenAI form is translated for the engine
(stop strings, top_k, logit_bias)."""

from __future__ import annotations

from engine.server.errors import invalid_param, unsupported_param
from engine.server.protocol import MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest, decimal


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise invalid_param("stop", items, f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(items):
        if not s:
            raise invalid_param(f"stop[{i}]" if not isinstance(stop, str) else "stop", s, "a stop string is empty")
    return tuple(items)


def refuse_completion_extras(req: CompletionRequest) -> None:
    if req.echo:
        raise unsupported_param("echo", req.echo, "echo is not supported")
    if req.suffix:
        raise unsupported_param("suffix", req.suffix, "suffix (fill-in-the-middle) is not supported")
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise unsupported_param("best_of", req.best_of, "best_of other than n is not supported (it would rank "
                                                        "choices by logprob); send n choices and rank them")


def refuse_chat_extras(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise invalid_param("top_logprobs", req.top_logprobs, "needs logprobs=true")
    if req.tools:
        raise unsupported_param("tools", f"<{len(req.tools)} tools>", "tool calling is not supported")
    if req.tool_choice not in (None, "none"):
        raise unsupported_param("tool_choice", req.tool_choice, "tool calling is not supported")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise unsupported_param("response_format", req.response_format, "only {'type': 'text'} is supported")


def top_k_or_off(top_k: int | None, vocab: int | None) -> int:
    """-1, 0 and any k the vocabulary cannot exceed all mean "off" (0)."""
    if top_k is None or top_k < 1 or (vocab is not None and top_k >= vocab):
        return 0
    return top_k


def logit_bias_pairs(bias: dict[str, float] | None, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (id, bias) pairs; keys that are not ids of this model are 400, and
    so are two keys naming one id ("7" and "007"): which bias was meant cannot be told."""
    if not bias:
        return ()
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token = decimal(key)  # the schema already holds keys to ASCII digits; this is the same rule
        if token is None or (vocab is not None and token >= vocab):
            limit = f" below {vocab}" if vocab is not None else ""
            raise invalid_param(f"logit_bias.{key}", key, f"keys must be token ids{limit}")
        if token in pairs:
            raise invalid_param(f"logit_bias.{key}", key, f"token id {token} is given twice")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))
