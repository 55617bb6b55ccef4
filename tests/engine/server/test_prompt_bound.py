"""A text prompt far past the context is refused for what a head of it holds: the tokenizer is handed a head of
the context's size, whatever the text's length, through the server's own path (the official openai client, a
real AsyncEngine with the embedded model's tokenizer on CPU). A prompt that can fit gets the ids it always got."""

from __future__ import annotations

import openai
import pytest

from engine.errors import PromptTooLong
from engine.model.prompt_heads import CUT_SLACK_TOKENS, HEAD_CHARS_PER_TOKEN
from engine.model.tokenizer import Tokenizer
from tests.engine.server.real import real_server

CONTEXT_TOKENS = 512
TEXT_BYTES = 50 << 20


class CountingBackend:
    """A `tokenizers.Tokenizer`, noting how many characters each encode is handed (what it then works through)."""

    def __init__(self, real, chars: list[int]) -> None:
        self._real = real
        self.chars = chars

    def encode_batch(self, texts, *args, **kwargs):
        self.chars.extend(len(t) for t in texts)
        return self._real.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def counting(real: Tokenizer) -> tuple[Tokenizer, list[int]]:
    """The engine's tokenizer over its own `tokenizers` backends, each counted."""
    chars: list[int] = []
    tok = Tokenizer(CountingBackend(real._tok, chars), real.chat_template, real.special)
    tok._plain = CountingBackend(real._plain_text_tokenizer(), chars)
    return tok, chars


@pytest.fixture(scope="module")
def server():
    try:
        with real_server("builtin:strata-tiny", batch=1, context=CONTEXT_TOKENS, max_body_mib=64) as running:
            yield running
    except FileNotFoundError as exc:
        pytest.skip(f"builtin:strata-tiny is not available: {exc}")


# A head this long is past the context for any text this tokenizer packs at most HEAD_CHARS_PER_TOKEN
# characters a token; the texts below pack fewer.
HEAD_BOUND_CHARS = 2 * HEAD_CHARS_PER_TOKEN * (CONTEXT_TOKENS + CUT_SLACK_TOKENS)


@pytest.mark.parametrize("unit", ["日本語の文章", "aGVsbG8gd29ybGQ", "word "], ids=["cjk", "base64", "words"])
def test_a_text_of_50_mb_is_refused_from_a_head_of_the_contexts_size(server, unit: str) -> None:
    url, client, _ = server
    # the engine's own tokenizer, its backend counted: fault injection, not a stand-in
    client.engine.tokenizer, chars = counting(client.engine.tokenizer)
    text = unit * (TEXT_BYTES // len(unit.encode()))
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="builtin:strata-tiny", prompt=text, max_tokens=1)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
    assert "at least" in error["message"] and f"context is {CONTEXT_TOKENS} tokens" in error["message"], error
    assert chars, "the prompt never reached the tokenizer"
    assert sum(chars) <= HEAD_BOUND_CHARS, (
        f"the tokenizer was handed {sum(chars):,} characters of a {len(text):,}-character text "
        f"(calls: {chars[:8]}); a head of {HEAD_BOUND_CHARS:,} settles it")


@pytest.mark.parametrize("text", [
    "Paris 日本語 🙂 done " * 40,  # spaced: within the context
    "日本語" * 160,  # no spaces, within the context
    ("x" + " " * 200) * 12,  # many characters a token: its heads do not settle it, it is encoded whole
    "café " * 100 + "e\u0301" * 50,  # combining marks
])
def test_a_prompt_that_can_fit_gets_the_same_ids_as_before(text: str) -> None:
    tok = Tokenizer.from_dir(_builtin_dir())
    plain = tok.encode(text, specials_in_text=False)
    if len(plain) <= CONTEXT_TOKENS:
        assert tok.encode(text, specials_in_text=False, max_tokens=CONTEXT_TOKENS) == plain
    assert tok.encode(text, specials_in_text=False, max_tokens=len(plain)) == plain  # exactly at the limit
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, specials_in_text=False, max_tokens=len(plain) - 1)
    assert info.value.prompt_tokens >= len(plain) - 1 - CUT_SLACK_TOKENS


def test_a_sparse_text_just_past_the_context_is_counted_exactly() -> None:
    # many characters a token: a head that does not settle it leads to a larger head, then to the whole text
    tok = Tokenizer.from_dir(_builtin_dir())
    text = ("x" + " " * 200) * 400
    whole = len(tok.encode(text, specials_in_text=False))
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, specials_in_text=False, max_tokens=whole - 1)
    assert (info.value.prompt_tokens, info.value.at_least) == (whole, False)


def _builtin_dir():
    from engine.model import resolve_model_path

    return resolve_model_path("builtin:strata-tiny")


def test_a_text_far_past_the_context_is_refused_before_the_rest_of_its_body_is_sent(server) -> None:
    # the body announces 50 MB and sends its first 256 KiB: the answer comes without the rest (never read, parsed
    # or tokenized; the connection's rest would be dropped unparsed)
    import json
    import socket
    from urllib.parse import urlsplit

    url, _, _ = server
    body = json.dumps({"model": "builtin:strata-tiny", "prompt": "日本語の文章" * (TEXT_BYTES // 18)},
                      ensure_ascii=False).encode()
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (parts.netloc.encode(), len(body)))
        sock.sendall(body[:256 << 10])
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:500]
    error = json.loads(payload)["error"]
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"], error
