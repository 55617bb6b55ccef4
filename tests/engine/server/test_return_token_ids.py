"""vLLM's `return_token_ids` on /v1/completions, over the real AsyncEngine on CPU behind a live server.

The checkpoint is the tiny shape with the 0.6b model's vocabulary (151,936) over the toy tokenizer's 512 ids:
what the random benchmark checkpoints are. Ids the tokenizer does not know decode to empty text, so most
generated tokens have no text at all: a stream that sends only chunks with text would lose them.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.engine.server.real import openai_client, real_server

pytestmark = pytest.mark.timeout(180)
WIDE_VOCAB = 151_936  # the Qwen3-0.6B vocabulary, as `--random-model 0.6b` writes it
GREEDY = dict(max_tokens=8, temperature=0)
UNKNOWN_ID = 100_000  # past the tokenizer's 512 ids: no text
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from engine.model.random_checkpoint import write_random_checkpoint

    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("wide-vocab"), vocab_size=WIDE_VOCAB)
    with real_server(str(checkpoint), batch=2, context=256) as running:
        yield running


@pytest.fixture
def oai(served) -> openai.OpenAI:
    return openai_client(served[0])


def test_streamed_token_ids_are_the_non_streamed_ones_even_without_text(oai: openai.OpenAI, served) -> None:
    model = served[1].model_name
    prompt = [5, 17, 99, 3, 250]
    # the biased id wins every step: tokens the tokenizer does not know, so no text
    bias = {"logit_bias": {str(UNKNOWN_ID): 100}}
    whole = oai.completions.create(model=model, prompt=prompt, **GREEDY, **bias,
                                   extra_body={**EXACT, "return_token_ids": True})
    choice = whole.choices[0]
    assert choice.prompt_token_ids == prompt
    assert len(choice.token_ids) == whole.usage.completion_tokens == 8
    chunks = list(oai.completions.create(model=model, prompt=prompt, stream=True, **GREEDY, **bias,
                                         stream_options={"include_usage": True},
                                         extra_body={**EXACT, "return_token_ids": True}))
    with_choices = [c.choices[0] for c in chunks if c.choices]
    streamed = [t for c in with_choices for t in c.token_ids]
    assert streamed == choice.token_ids
    assert len(streamed) == chunks[-1].usage.completion_tokens
    # vLLM's shape: the prompt's ids on the first chunk of the choice only
    assert with_choices[0].prompt_token_ids == prompt
    assert all(c.prompt_token_ids is None for c in with_choices[1:])
    # the point of it: tokens whose text is empty still arrive, each in its own chunk
    assert any(c.token_ids and c.text == "" for c in with_choices), [(c.text, c.token_ids) for c in with_choices]


def test_without_the_field_no_token_ids_are_sent(served) -> None:
    url, model = served[0], served[1].model_name
    body = {"model": model, "prompt": [5, 17, 99], **GREEDY, **EXACT}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert set(whole["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        lines = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
    chunks = [json.loads(data) for data in lines if data != "[DONE]"]
    assert chunks and all(set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason"} for c in chunks)


def test_chat_refuses_the_field_by_name(served) -> None:
    """Only completions implement it: chat must not accept it and answer without the ids."""
    model = served[1].model_name
    resp = httpx.post(served[0] + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_token_ids": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "return_token_ids"
