"""`json.loads` for large request bodies, in steps short enough to run on the event loop between requests.

`json.loads` is one C call: on an 8 MiB array of token ids it holds the GIL for a tenth of a second, and
whatever thread runs it stops the event loop (and /health) just as long. This parser walks objects and
arrays itself, decodes each scalar with the json module's own C scanner (so it accepts and refuses exactly
what `json.loads` does), and parses runs of plain numbers inside arrays CHUNK_CHARS at a time with one
`json.loads` each. `loads_steps` is a generator that yields after CHUNK_CHARS of text or ITEMS_PER_STEP
elements, whichever comes first, so the event loop itself drives a parse and answers other requests between
two pieces: a worker thread would contend for the GIL instead, and the loop would wait up to the
interpreter's switch interval each time it takes the GIL back. A string longer than CHUNK_CHARS (a prompt of
megabytes) is scanned and decoded CHUNK_CHARS at a time too (`_long_string`): one C call over all of it held
the loop for tens of milliseconds on a loaded machine. The body's bytes are decoded to text in pieces as well.
Nesting is bounded by Python's recursion limit, as in `json.loads` (RecursionError).
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any, Generator, TypeVar

CHUNK_CHARS = 1 << 16  # a piece: ~10k token ids, well under a millisecond of C
ITEMS_PER_STEP = 1 << 8  # elements parsed one by one (strings, objects, short number runs) between two yields
MIN_PIECE_CHARS = 64  # a shorter run of numbers is parsed element by element (cheaper than a piece)
_WS = " \t\n\r"
_NUMBER_RUN = re.compile(r"[0-9+\-.eE \t\n\r,]*")  # what a run of plain numbers may hold
_NUMBER_STARTS = tuple("-0123456789")
# A cut with no backslash in the 6 characters before it splits no escape (\uXXXX is the longest) and no
# surrogate pair (a high half that ended at the cut would hold a backslash there)
_ESCAPE_CHARS = 6
_SLASH_RUN = 64  # backslashes before a quote counted here; a longer run is left to the C scanner
_OPENERS = ("{", "[")
_DECODER = json.JSONDecoder()

T = TypeVar("T")
Steps = Generator[None, None, T]  # yields between pieces of work; returns the result


class TooManyItems(ValueError):
    """An array longer than `max_items`: refused once the parser passes the limit, the rest unparsed."""

    def __init__(self, max_items: int, member: str | None = None) -> None:
        super().__init__(f"an array holds more than {max_items} items")
        self.max_items = max_items
        self.member = member  # the top-level member whose own limit (member_items) it passed, if one did


class UnendedText(ValueError):
    """A top-level member named in `text_members` holds a string that the text ends inside (a body not all in
    yet): `head` is what of it is in, decoded."""

    def __init__(self, member: str, head: str) -> None:
        super().__init__(f"the string in {member!r} is not ended")
        self.member = member
        self.head = head


class _Walk:
    """What one parse carries through its recursion: the text, the array limit and when it next yields."""

    __slots__ = ("text", "max_items", "member_items", "text_members", "member", "yield_at", "items_left")

    def __init__(self, text: str, max_items: int | None, member_items: dict[str, int],
                 text_members: frozenset[str] = frozenset()) -> None:
        self.text = text
        self.max_items = max_items
        self.member_items = member_items
        self.text_members = text_members
        self.member: str | None = None  # the top-level member being parsed under its own limit
        self.yield_at = CHUNK_CHARS
        self.items_left = ITEMS_PER_STEP

    def due(self, i: int, items: int) -> bool:
        """Count `items` more elements parsed, the walk now at `i`: True when it is time to yield (and the
        next step's budget starts)."""
        self.items_left -= items
        if self.items_left > 0 and i < self.yield_at:
            return False
        self.items_left = ITEMS_PER_STEP
        self.yield_at = i + CHUNK_CHARS
        return True


def finish(steps: Steps[T]) -> T:
    """Run `steps` to its end at once and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def loads(raw: bytes | str, max_items: int | None = None, member_items: dict[str, int] | None = None) -> Any:
    """What `json.loads(raw)` returns (ValueError where it raises one), without one long hold of the GIL.
    `max_items`: TooManyItems as soon as an array passes it (an 8 MiB prompt of ids is refused after the
    first few thousand, not after all of it)."""
    return finish(loads_steps(raw, max_items, member_items))


def loads_steps(raw: bytes | str, max_items: int | None = None, member_items: dict[str, int] | None = None,
                text_members: frozenset[str] = frozenset()) -> Steps[Any]:
    """`loads` as steps: a generator that yields between pieces and returns the value. `member_items`: a
    lower limit for the arrays in some members of the top-level object (TooManyItems names the member).
    `text_members`: top-level members whose string, cut by the end of `raw` (the first part of a body),
    raises UnendedText with what of it is there."""
    text = raw if isinstance(raw, str) else (yield from _decoded(raw))
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    walk = _Walk(text, max_items, member_items or {}, text_members)
    if text.startswith("{", _skip(text, 0)):
        value, end = yield from _object(walk, _skip(text, 0) + 1, top=True)
    else:
        value, end = yield from _value(walk, _skip(text, 0))
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _decoded(raw: bytes | bytearray) -> Steps[str]:
    """`raw` as text (the encoding json.loads detects), a piece per step."""
    if len(raw) <= CHUNK_CHARS:
        return raw.decode(json.detect_encoding(raw), "surrogatepass")
    decoder = codecs.getincrementaldecoder(json.detect_encoding(raw))("surrogatepass")
    view, parts = memoryview(raw), []
    for start in range(0, len(raw), CHUNK_CHARS * 4):
        parts.append(decoder.decode(view[start:start + CHUNK_CHARS * 4]))
        yield
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def _long_string(text: str, i: int) -> Steps[tuple[str, int]]:
    """The string that starts at `i` (a quote), what `raw_decode` gives for it, a piece a step: its closing
    quote is found CHUNK_CHARS at a time, then it is decoded piece by piece by the json module's own scanner
    (cut where no escape or surrogate pair is split). Anything that is not valid JSON is left to `raw_decode`,
    which words the error as json.loads does."""
    n, pos = len(text), i + 1
    while True:
        quote = text.find('"', pos, min(n, pos + CHUNK_CHARS))
        if quote == -1:
            if pos + CHUNK_CHARS >= n:
                return _DECODER.raw_decode(text, i)  # no closing quote
            pos += CHUNK_CHARS
            yield
            continue
        before = text[max(pos, quote - _SLASH_RUN):quote]
        slashes = len(before) - len(before.rstrip("\\"))
        if slashes == _SLASH_RUN:
            return _DECODER.raw_decode(text, i)  # a run of backslashes: the C scanner counts it
        if slashes % 2 == 0:
            break  # an unescaped quote: the end
        pos = quote + 1
    end = quote
    parts, start = [], i + 1
    try:
        while start < end:
            cut = min(end, start + CHUNK_CHARS)
            while cut < end and text.rfind("\\", cut - _ESCAPE_CHARS, cut) != -1:
                cut -= 1
                if cut - _ESCAPE_CHARS <= start:  # escapes everywhere: no safe cut
                    return _DECODER.raw_decode(text, i)
            parts.append(_DECODER.decode('"' + text[start:cut] + '"'))
            start = cut
            yield
    except ValueError:
        return _DECODER.raw_decode(text, i)  # a control character or a bad escape: json's own error
    return "".join(parts), end + 1


def _scalar(text: str, i: int) -> Steps[tuple[Any, int]]:
    """A string, number or literal at `i`: the C scanner, a long string in pieces."""
    if text.startswith('"', i):
        quote = text.find('"', i + 1, i + CHUNK_CHARS)
        if quote == -1 or text[quote - 1] == "\\":  # long, or an escaped quote: maybe long
            return (yield from _long_string(text, i))
    return _DECODER.raw_decode(text, i)


def _unended(text: str, i: int) -> bool:
    """The string that starts at `i` has no closing quote before the end of `text` (one C scan)."""
    quote = text.find('"', i + 1)
    while quote != -1:
        before = text[max(i + 1, quote - _SLASH_RUN):quote]
        if (len(before) - len(before.rstrip("\\"))) % 2 == 0:
            return False
        quote = text.find('"', quote + 1)
    return True


def _head_of(text: str, i: int) -> str:
    """What is there of the unended string at `i`, decoded by the json module's scanner, cut where no escape is
    split ("" where it holds what is no JSON: the whole body's parse words that error)."""
    cut = len(text)
    while cut > i + 1 and text.rfind("\\", max(i + 1, cut - _ESCAPE_CHARS), cut) != -1:
        cut -= 1
    try:
        return _DECODER.decode('"' + text[i + 1:cut] + '"')
    except ValueError:
        return ""


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _value(walk: _Walk, i: int) -> Steps[tuple[Any, int]]:
    if walk.text.startswith("{", i):
        return (yield from _object(walk, i + 1))
    if walk.text.startswith("[", i):
        return (yield from _array(walk, i + 1))
    return (yield from _scalar(walk.text, i))  # a string, number or literal


def _object(walk: _Walk, i: int, top: bool = False) -> Steps[tuple[dict, int]]:
    text = walk.text
    out: dict = {}
    i = _skip(text, i)
    if i < len(text) and text[i] == "}":
        return out, i + 1
    while True:
        if i >= len(text) or text[i] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = yield from _scalar(text, i)
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        i = _skip(text, i + 1)
        own_limit = walk.member_items.get(key) if top else None
        if own_limit is not None and text.startswith(_OPENERS, i):
            outer_limit, walk.member = walk.max_items, key
            walk.max_items = own_limit if outer_limit is None else min(own_limit, outer_limit)
            out[key], i = yield from _value(walk, i)
            walk.max_items, walk.member = outer_limit, None
        elif text.startswith(_OPENERS, i):
            out[key], i = yield from _value(walk, i)
        elif top and key in walk.text_members and text.startswith('"', i) and _unended(text, i):
            raise UnendedText(key, _head_of(text, i))
        else:
            out[key], i = yield from _scalar(text, i)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
            if walk.due(i, 1):
                yield
            continue
        if i < len(text) and text[i] == "}":
            return out, i + 1
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _array(walk: _Walk, i: int) -> Steps[tuple[list, int]]:
    text, max_items = walk.text, walk.max_items
    out: list = []
    i = _skip(text, i)
    if i < len(text) and text[i] == "]":
        return out, i + 1
    while True:
        if text.startswith(_NUMBER_STARTS, i):
            i, count = _number_piece(text, i, out)
            if count:
                if max_items is not None and len(out) > max_items:
                    raise TooManyItems(max_items, walk.member)
                if walk.due(i, count):
                    yield
                continue
        if text.startswith(_OPENERS, i):
            item, i = yield from _value(walk, i)
        else:
            item, i = yield from _scalar(text, i)
        out.append(item)
        if max_items is not None and len(out) > max_items:
            raise TooManyItems(max_items, walk.member)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
            if walk.due(i, 1):
                yield
            continue
        if i < len(text) and text[i] == "]":
            return out, i + 1
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _number_piece(text: str, i: int, out: list) -> tuple[int, int]:
    """Append the plain numbers of the piece that starts at `i` (at most CHUNK_CHARS): where the rest begins
    (the start of one more element) and how many were appended (0: none, the elements are left to the
    element-by-element path, which words errors as json.loads does). A piece ends at the last comma before
    the first character no number, comma or space holds, so finding it costs only what it covers."""
    run_end = _NUMBER_RUN.match(text, i, i + CHUNK_CHARS).end()
    cut = text.rfind(",", i, run_end)
    if cut - i < MIN_PIECE_CHARS:
        return i, 0
    try:
        numbers = json.loads("[" + text[i:cut] + "]")
    except ValueError:
        return i, 0
    out.extend(numbers)
    return _skip(text, cut + 1), len(numbers)
