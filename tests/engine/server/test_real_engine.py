"""The server over the real AsyncEngine on CPU, spoken to with the official `openai` client and httpx.

One random tiny Qwen3 checkpoint; engines are shared per module where the tests do not interfere.
Greedy sampling (temperature 0) and `ignore_eos` keep outputs and token counts exact.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from tests.engine.server.real import busy_slots, random_checkpoint, real_server, wait_until

pytestmark = pytest.mark.timeout(180)
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return random_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def served(checkpoint):
    with real_server(str(checkpoint), batch=6, context=1024) as running:
        yield running


@pytest.fixture
def oai(served) -> openai.OpenAI:
    url, _, _ = served
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def model(served) -> str:
    return served[1].model_name


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from engine.model import Tokenizer

    return Tokenizer.from_dir(checkpoint)


def test_models_and_greedy_completion_with_usage(oai: openai.OpenAI, model: str, tokenizer) -> None:
    assert [m.id for m in oai.models.list().data] == [model]
    first = oai.completions.create(model=model, prompt="hello world", max_tokens=5, temperature=0, extra_body=EXACT)
    again = oai.completions.create(model=model, prompt="hello world", max_tokens=5, temperature=0, extra_body=EXACT)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert first.choices[0].text == again.choices[0].text  # greedy is deterministic


def test_prompt_as_token_ids_matches_the_text_prompt(oai: openai.OpenAI, model: str, tokenizer) -> None:
    ids = tokenizer.encode("the same prompt")
    by_text = oai.completions.create(model=model, prompt="the same prompt", max_tokens=4, temperature=0,
                                     extra_body=EXACT)
    by_ids = oai.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, extra_body=EXACT)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_cuts_the_text_and_reports_stop(oai: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="a stop test", temperature=0, extra_body=EXACT)
    full = oai.completions.create(max_tokens=12, **kw).choices[0].text
    assert len(full) >= 4, full
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = oai.completions.create(max_tokens=12, stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_seed_makes_sampling_repeatable(oai: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="random walk", max_tokens=12, temperature=1.0, top_p=0.95, extra_body=EXACT)
    texts = [oai.completions.create(seed=seed, **kw).choices[0].text for seed in (1, 1, 2, 3)]
    assert texts[0] == texts[1]
    assert len(set(texts[1:])) > 1, texts  # three seeds over a random model's flat distribution


def test_chat_completion(oai: openai.OpenAI, model: str, tokenizer) -> None:
    resp = oai.chat.completions.create(model=model, max_tokens=4, temperature=0, extra_body=EXACT,
                                       messages=[{"role": "system", "content": "terse"},
                                                 {"role": "user", "content": "hi"}])
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.usage.completion_tokens == 4
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}])
    assert resp.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_streaming_equals_non_streaming(oai: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="stream me", max_tokens=6, temperature=0, extra_body=EXACT)
    whole = oai.completions.create(**kw).choices[0].text
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    chat_kw = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
                   extra_body=EXACT)
    chat_whole = oai.chat.completions.create(**chat_kw).choices[0].message.content
    chat_chunks = list(oai.chat.completions.create(stream=True, **chat_kw))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_repeated_prompt_reports_cached_tokens(oai: openai.OpenAI, model: str) -> None:
    prompt = [3 + (i * 7) % 500 for i in range(600)]  # longer than two prefix blocks, used by no other test
    first = oai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=EXACT)
    second = oai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=EXACT)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < 600, cached
    assert second.choices[0].text == first.choices[0].text


def test_errors_in_openai_shape_and_the_engine_stays_up(oai: openai.OpenAI, model: str, served) -> None:
    url = served[0]
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.completions.create(model=model, prompt=[1 + i % 500 for i in range(1099)], max_tokens=1)  # in-vocab ids
    assert "1099" in str(too_long.value) and "1024" in str(too_long.value)
    with pytest.raises(openai.BadRequestError) as too_many:
        oai.completions.create(model=model, prompt=[1 + i % 500 for i in range(1000)], max_tokens=100)
    assert too_many.value.body["param"] == "max_tokens" and "24" in too_many.value.body["message"]
    with pytest.raises(openai.BadRequestError) as hot:
        oai.completions.create(model=model, prompt="x", temperature=7)
    assert hot.value.body["param"] == "temperature" and "7" in hot.value.body["message"]
    with pytest.raises(openai.BadRequestError) as many:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=17)
    assert many.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="no-such-model", prompt="x")
    assert missing.value.body["param"] == "model"
    bad_json = httpx.post(url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "malformed_json"
    ok = oai.completions.create(model=model, prompt="still alive", max_tokens=2, extra_body=EXACT)
    assert ok.usage.completion_tokens == 2
    assert httpx.get(url + "/health").status_code == 200


def test_client_dropping_mid_stream_frees_its_slot(served, model: str) -> None:
    url = served[0]
    body = {"model": model, "prompt": "a long story", "max_tokens": 900, "stream": True, **EXACT}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [ln for ln in (next(lines) for _ in range(6)) if ln.startswith("data: {")]
        assert got, "no chunk before the drop"
        assert busy_slots(url)[0] == 1
    assert wait_until(lambda: busy_slots(url) == (0, 0), timeout_s=5), busy_slots(url)


def test_fifty_concurrent_requests_on_six_slots_all_complete(served, model: str) -> None:
    url = served[0]

    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(
                client.completions.create(model=model, prompt=f"request number {i}", max_tokens=1 + i % 2,
                                          temperature=0.8, seed=i, extra_body=EXACT)
                for i in range(50)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert len({r.id for r in results}) == 50
    assert [r.usage.completion_tokens for r in results] == [1 + i % 2 for i in range(50)]
    assert busy_slots(url) == (0, 0)


def test_events_stream_seen_by_a_second_client(served, oai: openai.OpenAI, model: str) -> None:
    from engine.telemetry import WarningEvent

    url, client, _ = served
    events: list[tuple[str, dict]] = []
    connected = threading.Event()

    def listen() -> None:
        # Last-Event-ID = the current seq: live events only, so this test sees its own request's events.
        with httpx.stream("GET", url + "/strata/events", headers={"Last-Event-ID": str(client.bus.last_seq)},
                          timeout=30) as resp:
            connected.set()
            kind = None
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[6:])))
                    if events[-1][1].get("message") == "end of test":
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert connected.wait(10)
    resp = oai.completions.create(model=model, prompt="watch me", max_tokens=3, extra_body=EXACT)
    client.bus.publish(WarningEvent(where="test", message="end of test"))
    listener.join(10)
    assert not listener.is_alive()
    mine = [kind for kind, data in events if data.get("request_id") == resp.id]
    assert "admission" in mine and "slot" in mine, [e[0] for e in events]
    seqs = [data["seq"] for _, data in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(data["type"] == kind for kind, data in events)


def _raw_stream_request(url: str, body: dict):
    """A streaming request on a raw socket, so the test can drop it while the server still waits on it."""
    import socket
    from urllib.parse import urlparse

    payload = json.dumps(body).encode()
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_queue_full_is_503_with_retry_after_and_a_queued_client_that_leaves_is_dropped(checkpoint) -> None:
    with real_server(str(checkpoint), batch=1, queue_max=1, context=4096) as (url, client, _):
        model = client.model_name
        # Long enough that the first request still holds the slot however fast this machine steps.
        long_body = {"model": model, "prompt": "hold the slot", "max_tokens": 4000, "stream": True, **EXACT}
        running = _raw_stream_request(url, long_body)
        assert wait_until(lambda: busy_slots(url) == (1, 0)), busy_slots(url)
        queued = _raw_stream_request(url, long_body)
        assert wait_until(lambda: busy_slots(url) == (1, 1)), busy_slots(url)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as full:
            oai.completions.create(model=model, prompt="one too many", max_tokens=2)
        assert full.value.status_code == 503
        assert int(full.value.response.headers["retry-after"]) >= 1
        assert full.value.body["code"] == "queue_full"
        queued.close()  # the client leaves while its request waits for a slot
        assert wait_until(lambda: busy_slots(url) == (1, 0), timeout_s=5), busy_slots(url)
        running.close()
        assert wait_until(lambda: busy_slots(url) == (0, 0), timeout_s=5), busy_slots(url)
        ok = oai.completions.create(model=model, prompt="after", max_tokens=2, extra_body=EXACT)
        assert ok.usage.completion_tokens == 2


def test_dead_engine_answers_503_with_the_real_error(checkpoint) -> None:
    with real_server(str(checkpoint), batch=2, context=512) as (url, client, _):
        model = client.model_name
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def sticky_error(*_args, **_kwargs):  # what a device-side fault looks like from PyTorch
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        client.engine.executor._decode = sticky_error  # test-only fault injection into the engine, not the server
        with pytest.raises(openai.APIStatusError) as dead:
            oai.completions.create(model=model, prompt="trigger", max_tokens=4, extra_body=EXACT)
        assert dead.value.status_code == 503
        assert "illegal memory access" in dead.value.body["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        with pytest.raises(openai.APIStatusError) as again:
            oai.completions.create(model=model, prompt="and again", max_tokens=1)
        assert again.value.status_code == 503 and again.value.body["code"] == "engine_dead"


def test_out_of_range_token_ids_are_400_and_the_engine_stays_up(checkpoint) -> None:
    with real_server(str(checkpoint), batch=1, context=256) as (url, client, _):
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            oai.completions.create(model=client.model_name, prompt=[1, 2, 10**6], max_tokens=1)
        assert bad.value.body["param"] == "prompt" and "1000000" in bad.value.body["message"]
        assert httpx.get(url + "/health").status_code == 200


def test_control_routes_change_the_engine_and_emit_events(served) -> None:
    url, client, _ = served
    before = client.bus.last_seq
    on = httpx.post(url + "/strata/switches/SPLIT_ATTN", json={"enabled": True})
    assert on.status_code == 200 and on.json()["switch"]["enabled"] is True
    state = httpx.get(url + "/strata/state").json()
    assert next(s for s in state["switches"] if s["name"] == "SPLIT_ATTN")["enabled"] is True
    off = httpx.post(url + "/strata/switches/split_attn", json={"enabled": False})
    assert off.status_code == 200 and off.json()["switch"]["enabled"] is False
    restart = httpx.post(url + "/strata/switches/FUSED_PROJ", json={"enabled": False})  # on by default
    assert restart.status_code == 409 and "FUSED_PROJ" in restart.json()["error"]["message"]
    assert httpx.post(url + "/strata/switches/TURBO", json={"enabled": True}).status_code == 404
    reserve = httpx.post(url + "/strata/vram-reserve", json={"mib": 1280})
    assert reserve.status_code == 200 and reserve.json() == {"vram_reserve_mib": 1280}
    assert httpx.get(url + "/strata/state").json()["vram"][0]["reserve_mib"] == 1280
    changes = [(e.type, getattr(e, "state", None)) for e in client.bus.history(before)]
    assert ("switch", "on") in changes and ("switch", "off") in changes
    assert any(e.type == "vram" and e.reserve_mib == 1280 for e in client.bus.history(before))


def test_a_switch_that_cannot_run_here_answers_and_tells_so_when_toggled(served) -> None:
    # On CPU the paged kernels cannot run: a toggle must not look applied (the TUI draws what it is told).
    url, client, _ = served
    before = client.bus.last_seq
    for enabled in (False, True):
        answer = httpx.post(url + "/strata/switches/PAGED_ATTN", json={"enabled": enabled})
        assert answer.status_code == 200, answer.text
        switch = answer.json()["switch"]
        assert switch["enabled"] is False and switch["unavailable"] is True and "CUDA" in switch["reason"], switch
    changes = [(e.state, e.reason) for e in client.bus.history(before) if e.type == "switch"]
    assert len(changes) == 2 and all(state == "unavailable" and "CUDA" in reason for state, reason in changes), \
        changes
    state = next(s for s in httpx.get(url + "/strata/state").json()["switches"] if s["name"] == "PAGED_ATTN")
    assert state["unavailable"] is True and state["enabled"] is False


@pytest.mark.slow
def test_builtin_model_streams_the_same_text_with_and_without_mtp() -> None:
    """builtin:strata-tiny (the embedded model, with an MTP head): drafting may hand several tokens to one
    output increment; the streamed text must still equal the plain greedy text."""
    try:
        from engine.model import resolve_model_path

        resolve_model_path("builtin:strata-tiny")
    except Exception as exc:  # noqa: BLE001 - built by another part of the project
        pytest.skip(f"builtin:strata-tiny is not available: {exc}")
    texts = {}
    for mtp in (False, True):
        with real_server("builtin:strata-tiny", batch=2, batch_mtp=mtp, context=512) as (url, client, _):
            oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            chunks = list(oai.completions.create(model=client.model_name, prompt="def fibonacci(n):\n",
                                                 max_tokens=16, temperature=0, stream=True, extra_body=EXACT,
                                                 stream_options={"include_usage": True}))
            assert chunks[-1].usage.completion_tokens == 16
            texts[mtp] = "".join(c.choices[0].text for c in chunks if c.choices)
    assert texts[True] == texts[False] and texts[False].strip()
