"""Tokenizer: round trips, chat template, incremental decoding of split characters."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine

from engine.errors import CheckpointError, PromptTooLong
from engine.model import Tokenizer, prompt_heads


@pytest.fixture(scope="module")
def tok(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.mark.parametrize("text", ["Hello, world!", "  two spaces\nand a newline", "ünïcödé 日本語 🙂", ""])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_a_text_past_max_tokens_is_refused_with_its_count(tok):
    text = "Paris 日本語 🙂 done " * 40
    ids = tok.encode(text)
    assert tok.encode(text, max_tokens=len(ids)) == ids  # at the limit: the same ids
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, max_tokens=len(ids) - 1)
    assert (info.value.prompt_tokens, info.value.context_tokens) == (len(ids), len(ids) - 1)
    assert info.value.code == "context_length_exceeded"


def test_a_text_far_past_max_tokens_is_refused_from_its_head_with_a_lower_bound(tok):
    text = "Paris 日本語 🙂 done " * 2000
    whole = len(tok.encode(text))
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, max_tokens=100)
    assert info.value.at_least and 100 < info.value.prompt_tokens < whole  # counted from the head only
    assert "at least" in info.value.message


def test_a_text_without_spaces_is_refused_from_a_head_and_one_with_few_tokens_is_counted_whole(tok):
    unspaced = "日本語" * 4000  # no word start to cut at: cut where the head ends, between two characters
    whole = len(tok.encode(unspaced))
    with pytest.raises(PromptTooLong) as info:
        tok.encode(unspaced, max_tokens=100)
    assert info.value.at_least and 100 < info.value.prompt_tokens < whole
    # many characters a token (the embedded model's BPE merges runs of spaces): its head is counted and does
    # not settle it, so the text is counted whole
    builtin = Tokenizer.from_dir(Path(engine.__file__).parent / "models" / "strata-tiny")
    sparse = ("x" + " " * 200) * 200
    ids = builtin.encode(sparse)
    assert len(sparse) > prompt_heads.HEAD_CHARS_PER_TOKEN * (len(ids) + prompt_heads.CUT_SLACK_TOKENS)
    assert builtin.encode(sparse, max_tokens=len(ids)) == ids
    with pytest.raises(PromptTooLong) as info:
        builtin.encode(sparse, max_tokens=len(ids) - 1)
    assert not info.value.at_least and info.value.prompt_tokens == len(ids)


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


def test_a_byte_level_tokenizer_decodes_a_stream_through_its_byte_table_exactly_as_the_library(tok):
    """With hundreds of slots decoding, asking the library to decode two windows of ids per token was a large
    share of a step's host time: a byte-level BPE tokenizer's stream is its ids' bytes decoded as UTF-8, one table
    lookup a token. Random ids (invalid UTF-8 included), pushed one to three at a time, give the library's text."""
    import random

    from engine.model.byte_decoder import ByteLevelDecoder

    assert isinstance(tok.incremental_decoder(), ByteLevelDecoder)
    rng = random.Random(7)
    specials = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 3) for _ in range(rng.randint(1, 40))]  # past the vocabulary too
        ids[rng.randrange(len(ids))] = rng.choice([s for s in specials if s is not None])
        decoder, pieces, at = tok.incremental_decoder(), [], 0
        while at < len(ids):
            step = rng.randint(1, 3)
            pieces.append(decoder.push(ids[at:at + step]))
            at += step
        assert "".join(pieces) + decoder.flush() == tok.decode([i for i in ids if i < tok.vocab_size]), ids


def test_a_tokenizer_whose_decoder_is_not_byte_level_keeps_the_window_decoder(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from engine.model.tokenizer import IncrementalDecoder

    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece()
    hf.save(str(tmp_path / "tokenizer.json"))
    plain = Tokenizer.from_dir(tmp_path)
    decoder = plain.incremental_decoder()
    assert isinstance(decoder, IncrementalDecoder)
    assert "".join(decoder.push([i]) for i in (1, 2)) + decoder.flush() == plain.decode([1, 2])
