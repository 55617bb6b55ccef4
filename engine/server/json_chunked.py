"""`json.loads` for large request bodies, in pieces that each hold the GIL briefly.

`json.loads` is one C call: on an 8 MiB array of token ids it holds the GIL for a tenth of a second, and a
worker thread parsing it stalls the event loop (and /health) just as long; five such bodies at once stalled
it for most of a second. This parser walks objects and arrays itself, decodes each scalar with the json
module's own C scanner (so it accepts and refuses exactly what `json.loads` does), and parses runs of plain
numbers inside arrays CHUNK_CHARS at a time with one `json.loads` each: between two pieces the interpreter
can switch threads. Nesting is bounded by Python's recursion limit, as in `json.loads` (RecursionError).
"""

from __future__ import annotations

import json
from typing import Any

CHUNK_CHARS = 1 << 16  # a piece: ~10k token ids, well under a millisecond of C
_WS = " \t\n\r"
_NUMBER_RUN = str.maketrans("", "", "0123456789-+.eE \t\n\r,")
_DECODER = json.JSONDecoder()


class TooManyItems(ValueError):
    """An array longer than `max_items`: refused once the parser passes the limit, the rest unparsed."""

    def __init__(self, max_items: int) -> None:
        super().__init__(f"an array holds more than {max_items} items")
        self.max_items = max_items


def loads(raw: bytes | str, max_items: int | None = None) -> Any:
    """What `json.loads(raw)` returns (ValueError where it raises one), without one long hold of the GIL.
    `max_items`: TooManyItems as soon as an array passes it (an 8 MiB prompt of ids is refused after the
    first few thousand, not after all of it)."""
    text = raw if isinstance(raw, str) else raw.decode(json.detect_encoding(raw), "surrogatepass")
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    value, end = _value(text, _skip(text, 0), max_items)
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _value(text: str, i: int, max_items: int | None) -> tuple[Any, int]:
    if i >= len(text):
        raise json.JSONDecodeError("Expecting value", text, i)
    head = text[i]
    if head == "{":
        return _object(text, i + 1, max_items)
    if head == "[":
        return _array(text, i + 1, max_items)
    return _DECODER.raw_decode(text, i)  # a string, number or literal: the C scanner


def _object(text: str, i: int, max_items: int | None) -> tuple[dict, int]:
    out: dict = {}
    i = _skip(text, i)
    if i < len(text) and text[i] == "}":
        return out, i + 1
    while True:
        if i >= len(text) or text[i] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        out[key], i = _value(text, _skip(text, i + 1), max_items)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
            continue
        if i < len(text) and text[i] == "}":
            return out, i + 1
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _array(text: str, i: int, max_items: int | None) -> tuple[list, int]:
    out: list = []
    i = _skip(text, i)
    if i < len(text) and text[i] == "]":
        return out, i + 1
    while True:
        i = _number_run(text, i, out, max_items)
        item, i = _value(text, i, max_items)
        out.append(item)
        if max_items is not None and len(out) > max_items:
            raise TooManyItems(max_items)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
            continue
        if i < len(text) and text[i] == "]":
            return out, i + 1
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _number_run(text: str, i: int, out: list, max_items: int | None) -> int:
    """Append the plain numbers that start at `i`, a piece at a time; return where the rest begins (the start
    of one more element). Anything else in a piece (a string, a nested array, an error) leaves that piece to
    the element-by-element path, which words errors as json.loads does."""
    while True:
        window = text[i:i + CHUNK_CHARS]
        cut = window.rfind(",")
        if cut <= 0 or len(window) < 2:
            return i
        piece = window[:cut]
        if piece.translate(_NUMBER_RUN):  # something other than numbers, commas and spaces
            return i
        try:
            numbers = json.loads("[" + piece + "]")
        except ValueError:
            return i
        out.extend(numbers)
        if max_items is not None and len(out) > max_items:
            raise TooManyItems(max_items)
        i = _skip(text, i + cut + 1)
