"""Schema validation and error mapping over real HTTP (uvicorn on loopback) with a scripted engine client."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.config import EngineConfig
from engine.server.app import create_app
from tests.engine.server.fake_engine import FakeEngine
from tests.engine.server.live import LiveServer

MODEL = FakeEngine.model_name


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine(context_tokens=64)


@pytest.fixture
def url(fake: FakeEngine):
    with LiveServer(create_app(fake, EngineConfig(device="cpu"))) as base:
        yield base


def _post(url: str, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10, **kw)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_completion_text_and_usage(url: str) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    # The fake continues the alphabet after the prompt's last byte ('b' = 98).
    expected = "".join(chr(97 + (98 + i) % 26) for i in range(5))
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_prompt_as_token_ids_reaches_the_engine_unchanged(url: str, fake: FakeEngine) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert fake.requests[-1].prompt_token_ids == [5, 6, 7]
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": [[9, 10]], "max_tokens": 1})
    assert resp.status_code == 200 and fake.requests[-1].prompt_token_ids == [9, 10]


def test_sampling_parameters_are_passed_through(url: str, fake: FakeEngine) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0.5,
                                          "top_p": 0.9, "seed": 7, "stop": ["zz", "q"]})
    assert resp.status_code == 200, resp.text
    params = fake.requests[-1].params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop) == (
        3, 0.5, 0.9, 7, ("zz", "q"))


def test_malformed_json_is_400(url: str) -> None:
    resp = httpx.post(url + "/v1/completions", content=b'{"model": "x", "prompt": ', timeout=10,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = _error(resp)
    assert err["code"] == "malformed_json" and "malformed JSON" in err["message"]


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", 3.5, "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", 0, "top_p"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", -4, "max_tokens"),
        ("prompt", [1, -2], "prompt[1]"),
        ("stream", "perhaps", "stream"),
    ],
)
def test_invalid_parameter_is_400_naming_field_and_value(url: str, field: str, value: object, param: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    resp = _post(url, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert err["param"] == param
    assert param in err["message"] and repr(value if not isinstance(value, list) else value[1]) in err["message"]


def test_missing_field_is_named(url: str) -> None:
    err = _error(_post(url, "/v1/completions", {"model": MODEL}))
    assert err["param"] == "prompt" and "required" in err["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"n": 17}, "n"), ({"echo": True}, "echo"), ({"logprobs": 21}, "logprobs"), ({"best_of": 3}, "best_of"),
     ({"presence_penalty": 2.5}, "presence_penalty"), ({"prompt": ["a", "b"]}, "prompt"),
     ({"min_tokens": 3}, "min_tokens"), ({"guided_json": {"type": "object"}}, "guided_json"),
     ({"use_beam_search": True}, "use_beam_search"), ({"skip_special_tokens": False}, "skip_special_tokens"),
     ({"logit_bias": {"hello": 5}}, "logit_bias.hello"), ({"logit_bias": {"999": 5}}, "logit_bias.999"),
     ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"prompt": ""}, "prompt"), ({"prompt": [300]}, "prompt")],
)
def test_unsupported_or_bad_values_are_400_naming_them(url: str, extra: dict, param: str) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert err["param"] == param and param in err["message"]


def test_unknown_model_is_404(url: str) -> None:
    resp = _post(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert resp.status_code == 404
    err = _error(resp)
    assert err["param"] == "model" and "gpt-9" in err["message"] and MODEL in err["message"]


def test_prompt_longer_than_context_names_both_counts(url: str) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x" * 70})
    assert resp.status_code == 400
    err = _error(resp)
    assert "70" in err["message"] and "64" in err["message"] and err["code"] == "context_length_exceeded"


def test_max_tokens_beyond_what_is_left_names_the_numbers(url: str) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x" * 60, "max_tokens": 10})
    assert resp.status_code == 400
    err = _error(resp)
    assert err["param"] == "max_tokens"
    for number in ("10", "4", "60", "64"):
        assert number in err["message"], err["message"]


def test_completion_default_max_tokens_fits_what_is_left(url: str, fake: FakeEngine) -> None:
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x" * 60})
    assert resp.status_code == 200
    assert fake.requests[-1].params.max_tokens == 4  # min(16, 64 - 60)


def test_queue_full_is_503_with_retry_after(url: str, fake: FakeEngine) -> None:
    fake.queue_full = True
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "2"
    assert _error(resp)["code"] == "queue_full"
    fake.queue_full = False
    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_engine_dead_is_503_with_reason_and_health_says_so(url: str, fake: FakeEngine) -> None:
    fake.dead_reason = "CUDA error: an illegal memory access was encountered"
    resp = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert resp.status_code == 503
    assert "illegal memory access" in _error(resp)["message"]
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert "illegal memory access" in health.json()["reason"]


def test_health_loading_then_ready(url: str, fake: FakeEngine) -> None:
    fake.ready = False
    resp = httpx.get(url + "/health", timeout=10)
    assert resp.status_code == 503 and resp.json() == {"status": "loading", "reason": "loading: weights 3/7"}
    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi"}).status_code == 503
    fake.ready = True
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_chat_renders_through_the_engine_template(url: str, fake: FakeEngine) -> None:
    body = {"model": MODEL, "max_tokens": 3,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "yo"}]}]}
    resp = _post(url, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert fake.decode(fake.requests[-1].prompt_token_ids) == "<system>be brief\n<user>hi\nyo\n<assistant>"
    out = resp.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert len(out["choices"][0]["message"]["content"]) == 3


@pytest.mark.parametrize(
    ("messages", "param"),
    [([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
     ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
      "messages[0].content[0].type"),
     ([{"role": "user", "content": "RAISE"}], "messages")],
)
def test_chat_bad_messages_are_400_naming_the_path(url: str, messages: list, param: str) -> None:
    resp = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert resp.status_code == 400, resp.text
    assert _error(resp)["param"] == param


def test_a_text_part_without_text_is_400_naming_its_text(url: str) -> None:
    """Not "only text content parts are supported" for a part that is text: what it lacks is its `text`."""
    resp = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]})
    assert resp.status_code == 400, resp.text
    error = _error(resp)
    assert error["param"] == "messages[0].content[0].text", error
    assert "only text content parts" not in error["message"]


def test_streaming_completion_ends_with_done_and_usage(url: str) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "".join(chr(97 + (ord("a") + i) % 26) for i in range(4))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])


def test_auth_guards_every_route_but_health() -> None:
    fake = FakeEngine()
    with LiveServer(create_app(fake, EngineConfig(device="cpu", api_key="s3cret"))) as url:
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        bad = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert bad.status_code == 401 and _error(bad)["code"] == "invalid_api_key"
        ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
        assert _post(url, "/strata/switches/SPLIT_ATTN", {"enabled": True}).status_code == 401
        assert _post(url, "/strata/vram-reserve", {"mib": 5}).status_code == 401
        assert httpx.get(url + "/strata/state", timeout=10).status_code == 401
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert fake.requests == []


def test_switch_routes(url: str, fake: FakeEngine) -> None:
    ok = _post(url, "/strata/switches/SPLIT_ATTN", {"enabled": True})
    assert ok.status_code == 200 and ok.json()["switch"]["enabled"] is True
    assert any(e.type == "switch" and e.name == "SPLIT_ATTN" for e in fake.bus.history())
    restart = _post(url, "/strata/switches/FUSED_PROJ", {"enabled": False})  # on by default
    assert restart.status_code == 409 and "restart" in _error(restart)["message"]
    unknown = _post(url, "/strata/switches/TURBO", {"enabled": True})
    assert unknown.status_code == 404 and "TURBO" in _error(unknown)["message"]
    bad = _post(url, "/strata/switches/SPLIT_ATTN", {"enabled": "yes"})
    assert bad.status_code == 400 and _error(bad)["param"] == "enabled"


def test_vram_reserve_route(url: str, fake: FakeEngine) -> None:
    ok = _post(url, "/strata/vram-reserve", {"mib": 1280})
    assert ok.status_code == 200 and ok.json() == {"vram_reserve_mib": 1280} and fake.vram_reserve_mib == 1280
    for body, param in (({"mib": -1}, "mib"), ({"mib": "lots"}, "mib"), ({}, "mib"), ({"mib": 1, "x": 2}, "x")):
        resp = _post(url, "/strata/vram-reserve", body)
        assert resp.status_code == 400 and _error(resp)["param"] == param, (body, resp.text)


def test_unknown_route_is_openai_shaped_404(url: str) -> None:
    resp = httpx.get(url + "/v1/nothing", timeout=10)
    assert resp.status_code == 404 and _error(resp)["type"] == "not_found"


def test_metrics_count_requests_and_events(url: str, fake: FakeEngine) -> None:
    from engine.telemetry import GraphEvent, VramEvent

    fake.bus.publish(GraphEvent(action="capture", kind="decode", key="b1"))
    fake.bus.publish(GraphEvent(action="fail", kind="draft_round", key="b6", error="CUDA error: out of memory"))
    fake.bus.publish(VramEvent(device="cuda:0", total_mib=1000, weights_mib=400, tier_mib=123.5))
    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}).status_code == 200
    text = ""
    for _ in range(50):  # the bus consumer runs in the background: give it a moment
        text = httpx.get(url + "/metrics", timeout=10).text
        if 'strata_graph_events_total{action="fail",kind="draft_round"} 1.0' in text:
            break
        import time

        time.sleep(0.05)
    assert 'strata_graph_events_total{action="capture",kind="decode"} 1.0' in text
    assert 'strata_graph_events_total{action="fail",kind="draft_round"} 1.0' in text
    assert 'strata_vram_mib{device="cuda:0",part="weights"} 400.0' in text
    assert 'strata_tier_mib{device="cuda:0"} 123.5' in text
    assert "strata_generation_tokens_total 3.0" in text
    assert "strata_prompt_tokens_total 2.0" in text
    assert "strata_time_to_first_token_seconds_count 1.0" in text
    assert "strata_inter_token_latency_seconds_count 2.0" in text
    assert 'strata_draft_tokens_accepted_total{position="1"} 3.0' in text
    assert "strata_requests_running 0.0" in text
