"""Tokenizer: round trips, chat template, incremental decoding of split characters."""

from __future__ import annotations

import pytest

from engine.errors import CheckpointError
from engine.model import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.mark.parametrize("text", ["Hello, world!", "  two spaces\nand a newline", "ünïcödé 日本語 🙂", ""])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_chatml(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<|im_end|>") in ids


def test_incremental_decoder_holds_back_partial_characters(tok):
    text = "Paris 日本語 🙂 done"
    ids = tok.encode(text)
    decoder = tok.incremental_decoder()
    pieces = [decoder.push([i]) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(1 for piece in pieces if piece == "") > 0  # multi-byte characters really were split across ids


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert info.value.path == str(tmp_path / "tokenizer.json")


def test_incremental_decoder_does_not_hold_invalid_bytes_forever(tok):
    decoder = tok.incremental_decoder()
    # UTF-8 continuation bytes 0xA1..0xA6 never form a character; byte-level BPE spells them as chr(byte)
    byte_ids = [tok.token_to_id(chr(b)) for b in range(0xA1, 0xA7)]
    assert None not in byte_ids and tok.decode(byte_ids) == "\ufffd" * 6
    pieces = [decoder.push([i]) for i in byte_ids]
    assert "".join(pieces) != ""  # emitted before the end, not only at flush
