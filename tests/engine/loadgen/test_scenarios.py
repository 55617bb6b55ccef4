"""The load scenarios (engine/loadgen/scenarios.py) against an in-process OpenAI-shaped server. Torch-free."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.loadgen.scenarios import SCENARIOS, ScenarioProgress, get_scenario, run_scenario, scenario_names
from tests.engine.loadgen.test_scenarios_fakeserver import FakeOpenAIServer

ROOT = Path(__file__).resolve().parents[3]
SMALL_SEED = dict(concurrency=3, short_prompt_tokens=32, short_max_tokens=60, delay_s=0.1, long_tokens=2000,
                  long_max_tokens=4)


def test_registry_has_the_named_scenarios_with_documented_params() -> None:
    assert {"seed", "burst", "reuse"} <= set(scenario_names())
    seed = get_scenario("seed")
    defaults = seed.resolve({})
    assert defaults["concurrency"] == 6 and defaults["long_tokens"] == 150_000 and defaults["delay_s"] == 3.0
    for scenario in SCENARIOS.values():
        assert scenario.description
        assert all(p.help for p in scenario.params)


def test_unknown_scenario_and_bad_params_name_what_was_wrong() -> None:
    with pytest.raises(ConfigError, match="nope.*seed"):
        get_scenario("nope")
    with pytest.raises(ConfigError, match="long_token.*not a parameter.*long_tokens"):
        get_scenario("seed").resolve({"long_token": 5})
    with pytest.raises(ConfigError, match="long_tokens='many'.*whole number"):
        get_scenario("seed").resolve({"long_tokens": "many"})
    with pytest.raises(ConfigError, match="delay_s=-1"):
        get_scenario("seed").resolve({"delay_s": -1})
    with pytest.raises(ConfigError, match="ignore_eos=2.*<= 1"):
        get_scenario("burst").resolve({"ignore_eos": 2})
    assert get_scenario("seed").resolve({"long_tokens": "32000", "delay_s": "0.5"})["long_tokens"] == 32000


async def test_seed_runs_shorts_then_a_fresh_long_prompt_and_measures_the_slowdown() -> None:
    server = FakeOpenAIServer(vocab_size=1000, long_prompt_tokens=1000, slowdown=4.0)
    events: list[ScenarioProgress] = []
    async with server.client() as http:
        result = await run_scenario("seed", "http://fake", on_progress=events.append, http_client=http, **SMALL_SEED)

    assert result.ok, result.errors
    assert result.health_before.startswith("200") and result.health_after.startswith("200")
    assert [r.label for r in result.requests][:3] == ["short-0", "short-1", "short-2"]
    long = next(r for r in result.requests if r.label == "long")
    assert long.prompt_tokens == 2000 and long.cached_tokens == 0 and long.completion_tokens == 4
    assert long.start_s >= 0.1  # sent after delay_s
    assert all(r.completion_tokens == 60 and r.finish_reason == "length" for r in result.requests if r.kind == "short")
    # The long prompt's arrival slowed the decoding slots in the stand-in server: the ratio must show it.
    assert result.metrics["short_decode_tok_s_before"] > 0
    assert 0 < result.metrics["decode_ratio"] < 1
    kinds = [e.event for e in events]
    assert kinds[0] == "start" and kinds[-1] == "done"
    assert kinds.count("sent") == 4 and kinds.count("finished") == 4 and kinds.count("first_token") == 4
    assert events[-1].requests_done == events[-1].requests_total == 4
    assert {"model": "fake-model", "stream": True} == {k: server.bodies[0][k] for k in ("model", "stream")}


async def test_seed_by_default_keeps_the_shorts_decoding_until_the_long_prompt_is_done() -> None:
    server = FakeOpenAIServer(context_tokens=50_000, token_interval_s=0.002)
    params = dict(SMALL_SEED)
    del params["short_max_tokens"]  # default 0: until the long prompt is done
    async with server.client() as http:
        result = await run_scenario("seed", "http://fake", http_client=http, **params)
    assert result.ok, result.errors
    shorts = [r for r in result.requests if r.kind == "short"]
    long = result.requests[-1]
    assert all(b["max_tokens"] == 50_000 - 32 for b in server.bodies if len(b["prompt"]) == 32)
    assert all(r.finish_reason == "cancelled" and r.error is None and r.completion_tokens > 0 for r in shorts)
    assert all(r.end_s >= long.end_s for r in shorts), "stopped only after the long prompt finished"
    assert result.metrics["decode_ratio"] is not None
    # This server does not say how many slots it has: the result warns that the long prompt may have waited.
    assert [n for n in result.notes if "slot count" in n] == result.notes and len(result.notes) == 1


async def test_seed_stops_as_many_shorts_as_it_takes_to_free_a_slot_for_the_long_prompt() -> None:
    server = FakeOpenAIServer(context_tokens=50_000, token_interval_s=0.002, slots=2)
    params = dict(SMALL_SEED)
    del params["short_max_tokens"]
    async with server.client() as http:
        result = await run_scenario("seed", "http://fake", http_client=http, **params)
    assert result.ok, result.errors
    shorts, long = result.requests[:3], result.requests[-1]
    # 3 shorts on 2 slots: 2 stopped when the long prompt was sent, the third decodes through its prefill.
    assert all(r.end_s <= long.start_s + 0.05 for r in shorts[:2])
    assert shorts[2].end_s >= long.end_s
    assert any("2 stopped" in note for note in result.notes), result.notes
    assert result.metrics["decode_ratio"] is not None


async def test_seed_refuses_a_one_slot_server_before_sending_anything() -> None:
    server = FakeOpenAIServer(slots=1)
    params = dict(SMALL_SEED)
    del params["short_max_tokens"]
    async with server.client() as http:
        with pytest.raises(ConfigError, match="concurrency=3.*1 slot"):
            await run_scenario("seed", "http://fake", http_client=http, **params)
    assert server.bodies == []


async def test_long_prompt_ids_stay_in_range_and_start_with_a_fresh_nonce() -> None:
    server = FakeOpenAIServer(vocab_size=1000)
    params = dict(SMALL_SEED, concurrency=1, short_max_tokens=2, delay_s=0.0)
    async with server.client() as http:
        await run_scenario("seed", "http://fake", http_client=http, **params)
        await run_scenario("seed", "http://fake", http_client=http, **params)
    longs = [b["prompt"] for b in server.bodies if len(b["prompt"]) == 2000]
    assert len(longs) == 2
    assert longs[0][:16] != longs[1][:16], "the nonce must differ between runs"
    assert longs[0][16:] == longs[1][16:], "the filler is seeded, so only the nonce differs"
    ids = [t for body in server.bodies for t in body["prompt"]]
    assert max(ids) < 1000 - 1000 // 16 and min(ids) >= 0


async def test_reuse_sends_the_same_prompt_twice_and_reports_the_cache_hit() -> None:
    server = FakeOpenAIServer()
    async with server.client() as http:
        result = await run_scenario("reuse", "http://fake", http_client=http, long_tokens=1500, max_tokens=3)
    first, second = result.requests
    assert server.bodies[0]["prompt"] == server.bodies[1]["prompt"]
    assert first.cached_tokens == 0 and second.cached_tokens >= 1500 - 16
    assert result.metrics["second_cached_tokens"] == second.cached_tokens
    assert result.metrics["ttft_speedup"] > 1 and not result.notes


async def test_burst_sends_n_concurrent_requests() -> None:
    server = FakeOpenAIServer()
    async with server.client() as http:
        result = await run_scenario("burst", "http://fake", http_client=http, requests=5, max_tokens=7)
    assert len(result.requests) == 5 and result.ok
    assert sum(r.completion_tokens for r in result.requests) == 35
    assert result.metrics["aggregate_tok_s"] > 0 and result.metrics["ttft_max_s"] >= result.metrics["ttft_p50_s"]
    assert len({tuple(b["prompt"]) for b in server.bodies}) == 5, "each burst request has its own prompt"


async def test_a_prompt_past_the_engine_context_is_refused_before_anything_is_sent() -> None:
    server = FakeOpenAIServer(context_tokens=1024)
    async with server.client() as http:
        with pytest.raises(ConfigError, match=r"long_tokens=2000.*context is 1024 tokens.*--context 2004"):
            await run_scenario("seed", "http://fake", http_client=http, **SMALL_SEED)
    assert server.bodies == []


async def test_engine_death_is_recorded_with_the_health_reason_not_raised() -> None:
    server = FakeOpenAIServer(die_on_long=True, token_interval_s=0.02)
    async with server.client() as http:
        result = await run_scenario("seed", "http://fake", http_client=http, **SMALL_SEED)
    assert not result.ok
    assert any(e.startswith("long: RemoteProtocolError") for e in result.errors)
    assert result.health_after == "503 dead: CUDA error: out of memory"
    assert result.to_json()["ok"] is False


async def test_http_errors_keep_the_server_message_and_api_key_is_sent() -> None:
    server = FakeOpenAIServer(vocab_size=1000, api_key="sekrit")
    progress: list[str] = []

    async def on_progress(p: ScenarioProgress) -> None:  # async callbacks are awaited
        progress.append(p.event)

    async with server.client() as http:
        server.accept_ids_below = 10  # the server rejects ids the runner drew from the advertised vocab
        result = await run_scenario("burst", "http://fake", "sekrit", http_client=http, requests=2, max_tokens=2,
                                    on_progress=on_progress)
    assert all(r.error == "HTTP 400: prompt token id out of range" for r in result.requests)
    assert set(server.auth_headers) == {"Bearer sekrit"}
    assert progress.count("failed") == 2


async def test_wrong_key_is_a_clear_error_and_a_missing_vocab_falls_back() -> None:
    server = FakeOpenAIServer(api_key="right")
    async with server.client() as http:
        with pytest.raises(ConfigError, match="url='http://fake'.*401.*invalid api key"):
            await run_scenario("burst", "http://fake", "wrong", http_client=http)
    server = FakeOpenAIServer(models_has_vocab=False)
    async with server.client() as http:
        result_vocab = await run_scenario("burst", "http://fake", http_client=http, requests=1, max_tokens=1)
    assert result_vocab.ok and not result_vocab.notes  # /strata/state supplied the vocab size
    server = FakeOpenAIServer(models_has_vocab=False, state_has_vocab=False)
    async with server.client() as http:
        result = await run_scenario("burst", "http://fake", http_client=http, requests=3, max_tokens=1)
    assert result.ok and "vocab_size" in result.notes[0]
    assert max(t for body in server.bodies for t in body["prompt"]) < 256


async def test_a_strata_server_is_asked_for_token_ids_and_tokens_without_text_count() -> None:
    server = FakeOpenAIServer()
    async with server.client() as http:
        result = await run_scenario("burst", "http://fake", http_client=http, requests=2, max_tokens=6)
    assert result.ok, result.errors
    assert all(b["return_token_ids"] is True for b in server.bodies)
    for r in result.requests:  # each token its own increment of one, the ones with empty text included
        assert r.completion_tokens == 6 and [n for _, n in r.increments] == [1] * 6, r.increments


async def test_a_generic_openai_server_is_not_sent_token_ids() -> None:
    server = FakeOpenAIServer(has_state=False)  # no /strata/state: it may refuse a field it does not know
    async with server.client() as http:
        result = await run_scenario("burst", "http://fake", http_client=http, requests=2, max_tokens=3)
    assert result.ok and not any("return_token_ids" in b for b in server.bodies)
    assert all(r.completion_tokens == 3 and r.first_token_s is not None for r in result.requests)


async def test_a_strata_server_older_than_token_ids_is_asked_again_without_them() -> None:
    server = FakeOpenAIServer(knows_token_ids=False)
    async with server.client() as http:
        result = await run_scenario("reuse", "http://fake", http_client=http, long_tokens=100, max_tokens=3)
    assert result.ok, result.errors
    assert ["return_token_ids" in b for b in server.bodies] == [True, False, False]  # refused once, remembered
    assert all(r.completion_tokens == 3 for r in result.requests)


UNTIL_DONE_SEED = SMALL_SEED | dict(short_max_tokens=0)


async def test_until_done_shorts_decode_past_eos_until_the_long_prompt_is_done() -> None:
    # A model that says EOS at its first token (a random checkpoint may, greedily): the shorts must still be
    # decoding when the long prompt arrives, and be stopped by the scenario, not by EOS.
    server = FakeOpenAIServer(long_prompt_tokens=1000, eos_after_tokens=1)
    async with server.client() as http:
        result = await run_scenario("seed", "http://fake", http_client=http, **UNTIL_DONE_SEED)
    assert result.ok, result.errors
    shorts = [r for r in result.requests if r.kind == "short"]
    assert all(r.finish_reason == "cancelled" and r.completion_tokens > 1 for r in shorts), \
        [r.summary() for r in shorts]
    long_body = next(b for b in server.bodies if len(b["prompt"]) == 2000)
    assert [b.get("ignore_eos") for b in server.bodies if b is not long_body] == [True] * 3
    assert "ignore_eos" not in long_body  # its max_tokens is its length; its EOS is its own


async def test_a_server_that_refuses_ignore_eos_is_asked_again_without_it_and_the_result_says_so() -> None:
    server = FakeOpenAIServer(long_prompt_tokens=1000, eos_after_tokens=1, knows_ignore_eos=False)
    async with server.client() as http:
        result = await run_scenario("seed", "http://fake", http_client=http, **UNTIL_DONE_SEED)
    assert result.ok, result.errors
    assert ["ignore_eos" in b for b in server.bodies][:2] == [True, False]  # refused once, remembered
    assert sum("ignore_eos" in b for b in server.bodies) == 1
    assert all(r.finish_reason == "stop" for r in result.requests if r.kind == "short")
    assert any("refused ignore_eos" in note for note in result.notes), result.notes


async def test_ignore_eos_makes_every_request_generate_its_max_tokens() -> None:
    server = FakeOpenAIServer(eos_after_tokens=2)
    async with server.client() as http:
        plain = await run_scenario("burst", "http://fake", http_client=http, requests=2, max_tokens=5)
        exact = await run_scenario("burst", "http://fake", http_client=http, requests=2, max_tokens=5, ignore_eos=1)
    assert [(r.completion_tokens, r.finish_reason) for r in plain.requests] == [(2, "stop")] * 2
    assert [(r.completion_tokens, r.finish_reason) for r in exact.requests] == [(5, "length")] * 2


async def test_a_field_refused_only_in_the_message_is_recognised() -> None:
    # OpenAI's own API answers an unknown field with param null and the field in its message.
    from engine.loadgen.load_client import _refused_field

    openai_400 = '{"error": {"message": "Unrecognized request argument supplied: ignore_eos", "param": null}}'
    assert _refused_field(400, openai_400, ["return_token_ids", "ignore_eos"]) == "ignore_eos"
    assert _refused_field(400, openai_400, ["return_token_ids"]) is None  # not a field it sent
    assert _refused_field(400, '{"error": {"message": "prompt too long", "param": "prompt"}}', ["ignore_eos"]) is None
    assert _refused_field(500, openai_400, ["ignore_eos"]) is None


async def test_unreachable_server_names_the_url() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError, match=f"url='http://127.0.0.1:{port}'.*unreachable"):
        await run_scenario("burst", f"http://127.0.0.1:{port}")


def test_scenarios_module_is_torch_free() -> None:
    code = "import sys, engine.loadgen.scenarios; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
