"""What vLLM users send, through the official openai client against the real engine on CPU (issue 15,
item 6): n choices, logprobs / top_logprobs (completions and chat, stream and not), top_k, min_p,
repetition / presence / frequency penalties and logit_bias, with MTP drafting on."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from engine.api import GenerationRequest, SamplingParams
from tests.engine.server.real import openai_client, random_checkpoint, real_server

pytestmark = pytest.mark.timeout(180)
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from engine.model.random_checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", mtp_layout="deepseek")
    with real_server(str(ckpt), batch=4, context=512, batch_mtp=True, mtp_depth=2) as running:
        yield running


@pytest.fixture
def oai(served) -> openai.OpenAI:
    return openai_client(served[0])


@pytest.fixture
def model(served) -> str:
    return served[1].model_name


def test_n_choices_are_seeded_distinct_and_counted(oai, model) -> None:
    kw = dict(model=model, prompt="once upon", max_tokens=6, temperature=1.0, seed=5, n=3, extra_body=EXACT)
    first, again = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # reproducible with a seed
    assert len({c.text for c in first.choices}) > 1  # and the choices differ
    assert first.usage.completion_tokens == 18 and first.usage.prompt_tokens == again.usage.prompt_tokens


def test_n_choices_stream_with_their_index(oai, model) -> None:
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         n=2, stream=True, stream_options={"include_usage": True}, extra_body=EXACT)
    finished, texts, usage = set(), {0: "", 1: ""}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and usage.completion_tokens == 8


def test_completion_logprobs_stream_and_not(oai, model) -> None:
    kw = dict(model=model, prompt="the logprobs", max_tokens=5, temperature=0, logprobs=3, extra_body=EXACT)
    resp = oai.completions.create(**kw)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert abs(chosen - max(top.values())) < 1e-4  # greedy: the chosen token is the most likely one
    streamed = [c.choices[0].logprobs for c in oai.completions.create(**kw, stream=True) if c.choices]
    tokens = [t for part in streamed if part for t in part.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs_stream_and_not(oai, model) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "logprobs please"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=2, extra_body=EXACT)
    resp = oai.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    streamed = [c for chunk in oai.chat.completions.create(**kw, stream=True) for ch in chunk.choices
                if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_top_k_one_is_greedy_and_logit_bias_forces_a_token(oai, model, served) -> None:
    greedy = oai.completions.create(model=model, prompt="top k", max_tokens=8, temperature=0, extra_body=EXACT)
    top1 = oai.completions.create(model=model, prompt="top k", max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={**EXACT, "top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text  # today top_k was ignored: a sampled text
    client = served[1]
    token = client.encode("hello")[0]
    forced = oai.completions.create(model=model, prompt="bias", max_tokens=5, temperature=0,
                                    logit_bias={str(token): 100}, extra_body=EXACT)
    assert forced.choices[0].text == client.decode([token] * 5)


def test_penalties_change_greedy_output_the_way_they_should(served, model) -> None:
    """On the engine client (ids, not text): a strong presence penalty never repeats a token; a repetition
    penalty avoids the prompt's tokens."""
    client = served[1]

    async def ids(**params) -> list[int]:
        request = GenerationRequest(f"pen-{sorted(params)}", client.encode("a b a b a b"),
                                    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **params))
        return [t async for out in client.generate(request) for t in out.token_ids]

    plain = asyncio.run(ids())
    assert len(set(plain)) < len(plain)  # a random tiny model repeats itself
    present = asyncio.run(ids(presence_penalty=2.0))
    assert len(set(present)) == len(present)
    prompt_ids = set(client.encode("a b a b a b"))
    assert not prompt_ids & set(asyncio.run(ids(repetition_penalty=10.0)))


def test_result_changing_fields_are_refused_by_name_and_neutral_ones_accepted(served, model) -> None:
    url = served[0]
    base = {"model": model, "prompt": "x", "max_tokens": 1}
    for field, value in (("min_tokens", 2), ("use_beam_search", True), ("echo", True), ("suffix", "z"),
                         ("prompt_logprobs", 1), ("guided_regex", "a+"), ("best_of", 2)):
        resp = httpx.post(url + "/v1/completions", json={**base, field: value}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, (field, resp.text)
    neutral = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
               "skip_special_tokens": True}
    assert httpx.post(url + "/v1/completions", json={**base, **neutral}, timeout=30).status_code == 200
