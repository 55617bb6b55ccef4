"""A text far past the context, refused for what a head of it holds (`refuse_from_heads`).

Counting a prompt's tokens costs what its text costs: 7 MiB of CJK or base64 is seconds of a core. A text that is
past the context is usually past it within its first few context's worth of characters, so heads of it are counted
first, each larger than the last by what its own characters per token say the next needs, until one is past the
context (refused: a lower bound) or the next would be the whole text (then encoded as always: it may fit, and gets
the same ids).
"""

from __future__ import annotations

import unicodedata
from typing import Callable

from engine.errors import PromptTooLong

# A text longer than this many characters per allowed token has a head counted first: usual text runs 3-5
# characters a token, so that head is past the context, and the rest is never encoded.
HEAD_CHARS_PER_TOKEN = 8
# A cut inside a pre-token (a text without spaces is one) may change the count near the cut by a token or
# two; a head must pass the context by more than this to refuse the text.
CUT_SLACK_TOKENS = 16
_WORD_START_WINDOW = 4  # a word start is looked for in the last 1/4 of a head
_MAX_MARKS = 32  # combining marks stepped over to cut before a character, not between it and its marks


def refuse_from_heads(count: Callable[[str], int], text: str, max_tokens: int) -> None:
    """Raise PromptTooLong when a head of `text` holds more than `max_tokens` tokens (`count(head)`, plus the
    slack a cut may cost). Each head is at least twice the last, so what is counted in all is at most about twice
    the last head, which is bounded by the limit times the text's characters per token, not by its length."""
    limit = max_tokens + CUT_SLACK_TOKENS
    near = HEAD_CHARS_PER_TOKEN * limit
    while near < len(text):
        cut = head_cut(text, near)
        counted = count(text[:cut])
        if counted > limit:
            raise PromptTooLong(counted - CUT_SLACK_TOKENS, max_tokens, at_least=True)
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
