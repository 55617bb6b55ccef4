"""Incremental decoding for byte-level BPE tokenizers (Qwen, Llama 3, GPT-2 and the embedded model): each id is a
fixed run of bytes, so a stream's text is the UTF-8 decoding of its ids' bytes, one table lookup and one
incremental UTF-8 step a token.

The general path (engine.model.tokenizer.IncrementalDecoder) asks the tokenizer to decode two windows of ids for
every token: two crossings into the library for each decoding row of every step, where a table lookup does (the
host's part of a step grows with its rows, and with hundreds of slots it bounds the step). Here the table is built
once per tokenizer from the library's own vocabulary, by the rule its ByteLevel decoder applies (a token whose
characters are all in the byte alphabet is those bytes, any other token its own UTF-8; special tokens are
skipped), and the text is decoded as the library does (`errors="replace"`: each maximal invalid subpart one
U+FFFD). A tokenizer whose decoder is anything but ByteLevel alone keeps the general path (`byte_table`: None).
"""

from __future__ import annotations

import codecs
from typing import Any


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def byte_table(tokenizer: Any) -> list[bytes] | None:
    """Each id's bytes for a `tokenizers.Tokenizer` whose decoder is ByteLevel alone over a BPE model (special
    tokens: b""), or None where decoding takes more than that (another decoder, or a model that rewrites pieces)."""
    from tokenizers import decoders, models  # noqa: PLC0415 - the library's classes, as the tokenizer holds them

    model = tokenizer.model
    if not isinstance(tokenizer.decoder, decoders.ByteLevel) or not isinstance(model, models.BPE):
        return None
    if model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    alphabet = _byte_alphabet()
    as_latin1 = {ord(ch): chr(byte) for ch, byte in alphabet.items()}  # str.translate: C speed over 151K tokens
    outside = {ord(ch): None for ch in alphabet}
    table = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for piece, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id in special or not 0 <= token_id < len(table):
            continue
        if piece.translate(outside):  # a character outside the byte alphabet: the token is its own UTF-8
            table[token_id] = piece.encode("utf-8")
        else:
            table[token_id] = piece.translate(as_latin1).encode("latin-1")
    return table


class ByteLevelDecoder:
    """push(ids) -> the text they complete; flush() -> what is still held (an unfinished character at the end).
    The interface of engine.model.tokenizer.IncrementalDecoder. Ids past the table (a model's padded vocabulary)
    decode to nothing, as the library drops ids it does not know."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, new_ids: list[int]) -> str:
        table, size = self.table, len(self.table)
        data = b"".join(table[i] for i in new_ids if 0 <= i < size)
        return self._utf8.decode(data) if data else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
