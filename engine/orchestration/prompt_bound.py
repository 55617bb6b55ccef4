"""A prompt's text refused past the context for what a head of it holds, never for the whole of it.

A text far past the context cannot fit whatever its length, so its refusal should cost what counting a context's
worth of it costs: the tokenizer's own head check (engine/model/tokenizer.py) settles only a text with a word
start near its head, and encoded the rest whole (a 7 MiB text without spaces, CJK or base64, took 4-9 s of a
core on the embedded model's tokenizer, to be refused). Here heads of the text are counted, each larger than the
last by what its own characters per token say the next needs, until one is past the context (a refusal with a
lower bound) or the next would be the whole text (encoded as before: it may fit). A text that can fit is encoded
exactly as the tokenizer encodes it, so its ids do not change.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from engine.errors import PromptTooLong

# A text longer than this many characters per allowed token has a head counted first: usual text runs 3-5
# characters a token, so that head is past the context, and the rest is never encoded.
HEAD_CHARS_PER_TOKEN = 8
# A cut inside a pre-token (a text without spaces is one) may change the count near the cut by a token or
# two; a head must pass the context by more than this to refuse the text.
CUT_SLACK_TOKENS = 16
_WORD_START_WINDOW = 4  # a word start is looked for in the last 1/4 of a head
_MAX_MARKS = 32  # combining marks stepped over to cut before a character, not between it and its marks


def encode_within(tokenizer: Any, text: str, context_tokens: int, *, add_special_tokens: bool = True,
                  specials_in_text: bool = False) -> list[int]:
    """`tokenizer.encode(text, ...)` with the context as its `max_tokens`, refusing (PromptTooLong, a lower bound)
    a text whose head is already past the context, having encoded that head only."""
    def count(head: str) -> int:
        return len(tokenizer.encode(head, add_special_tokens=add_special_tokens, specials_in_text=specials_in_text))

    refuse_from_heads(count, text, context_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens, specials_in_text=specials_in_text,
                            max_tokens=context_tokens)


def refuse_from_heads(count: Any, text: str, context_tokens: int) -> None:
    """Raise PromptTooLong when a head of `text` holds more than `context_tokens` tokens (`count(head)`, plus the
    slack a cut may cost). Each head is at least twice the last, so what is encoded in all is at most about twice
    the last head, which is bounded by the context times the text's characters per token, not by its length."""
    limit = context_tokens + CUT_SLACK_TOKENS
    near = HEAD_CHARS_PER_TOKEN * limit
    while near < len(text):
        cut = head_cut(text, near)
        counted = count(text[:cut])
        if counted > limit:
            raise PromptTooLong(counted - CUT_SLACK_TOKENS, context_tokens, at_least=True)
        # At this head's characters a token, a head of `limit + slack` tokens is this long: twice at least.
        near = max(2 * cut, cut * (limit + CUT_SLACK_TOKENS) // max(counted, 1))


def head_cut(text: str, near: int) -> int:
    """Where to cut the head that ends near `near`: at a word start (a space after a non-space) in the last
    quarter before it, where byte-level and metaspace tokenizers start a pre-token, so the head's ids are the
    text's first ids; in a text without one (CJK, base64, a run of one character), at `near` itself, never
    between a character and its combining marks."""
    floor = near - near // _WORD_START_WINDOW
    at = text.rfind(" ", floor, near + 1)
    while at > floor:
        if not text[at - 1].isspace():
            return at
        at = text.rfind(" ", floor, at)
    cut = near
    while cut > near - _MAX_MARKS and unicodedata.combining(text[cut]):
        cut -= 1
    return cut
