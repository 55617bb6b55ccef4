"""Token logprobs in the two OpenAI shapes: legacy completions and chat.

The engine reports token ids with their logprobs (`engine.api.TokenLogprob`, the raw model distribution,
as vLLM does by default); the text of each token is its own decode, so a token that is part of a UTF-8
character reads as U+FFFD in `token` while `bytes` (chat) carries the exact bytes that are known.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from engine.api import TokenLogprob

Decode = Callable[[list[int]], str]


class CompletionLogprobs:
    """`{tokens, token_logprobs, top_logprobs, text_offset}` of one choice, built increment by increment
    (a stream sends each chunk's part; `text_offset` keeps counting across them)."""

    def __init__(self, decode: Decode, top: int) -> None:
        self.decode = decode
        self.top = top
        self.offset_chars = 0

    def part(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in logprobs:
            text = self.decode([lp.token_id])
            tokens.append(text)
            offsets.append(self.offset_chars)
            self.offset_chars += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.decode([t]): v for t, v in lp.top} if self.top else None for lp in logprobs],
            "text_offset": offsets,
        }


def chat_logprobs(decode: Decode, logprobs: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs: [...]}]}` for the tokens of one chunk or reply."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top[:top]]
        content.append(item)
    return {"content": content}
