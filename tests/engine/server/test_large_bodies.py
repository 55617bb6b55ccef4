"""Large bodies are parsed on the event loop in steps, with the loop's other work between two steps; long
token-id prompts come out exactly as the validator alone makes them, and are refused exactly as it does."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from engine.config import EngineConfig
from engine.server import json_chunked, protocol, uvicorn_server
from engine.server.app import create_app
from engine.server.errors import ApiError
from engine.server.protocol import CompletionRequest, parse_body
from tests.engine.server.fake_engine import FakeEngine
from tests.engine.server.live import LiveServer

MODEL = FakeEngine.model_name


def _events_while_posting(engine: FakeEngine, body: bytes, monkeypatch) -> tuple[httpx.Response, list, int]:
    """POST `body` to a real server while a probe coroutine on its loop logs each turn it gets; each piece of
    numbers the parser takes logs the thread it ran on. Returns the response, the log and the loop's thread."""
    log: list = []
    real_piece = json_chunked._number_piece

    def logged_piece(text: str, i: int, out: list) -> tuple[int, int]:
        log.append(("piece", threading.get_ident()))
        return real_piece(text, i, out)

    monkeypatch.setattr(json_chunked, "_number_piece", logged_piece)
    app = create_app(engine, EngineConfig(device="cpu"))
    server = LiveServer(app, config=uvicorn_server.server_config(app))
    with server as url:
        stop = threading.Event()

        async def probe() -> None:
            while not stop.is_set():
                log.append(("probe", None))
                await asyncio.sleep(0)

        assert server.loop is not None
        probing = asyncio.run_coroutine_threadsafe(probe(), server.loop)
        try:
            resp = httpx.post(url + "/v1/completions", content=body, timeout=120,
                              headers={"content-type": "application/json"})
        finally:
            stop.set()
            probing.result(timeout=10)
        return resp, log, server._thread.ident


def _assert_pieces_on_the_loop_between_its_turns(log: list, loop_thread: int | None, at_least: int) -> None:
    pieces = [i for i, (kind, _) in enumerate(log) if kind == "piece"]
    assert len(pieces) >= at_least, log[:40]
    assert {log[i][1] for i in pieces} == {loop_thread}, "a piece was parsed off the event loop's thread"
    between = [log[a + 1:b] for a, b in zip(pieces, pieces[1:])]
    assert all(("probe", None) in gap for gap in between), "two pieces ran without the loop's other work between"


def test_an_in_context_token_id_prompt_is_parsed_on_the_loop_between_its_other_work(monkeypatch) -> None:
    engine = FakeEngine(context_tokens=1 << 20)
    ids = [12, 7, 255, 0] * 60_000
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
    resp, log, loop_thread = _events_while_posting(engine, body, monkeypatch)
    assert resp.status_code == 200, resp.text
    assert engine.requests[-1].prompt_token_ids == ids
    _assert_pieces_on_the_loop_between_its_turns(log, loop_thread, at_least=10)


def test_a_prompt_past_the_context_is_refused_from_steps_on_the_loop(monkeypatch) -> None:
    engine = FakeEngine(context_tokens=100_000)
    body = json.dumps({"model": MODEL, "prompt": [12] * 400_000, "max_tokens": 1}).encode()
    resp, log, loop_thread = _events_while_posting(engine, body, monkeypatch)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
    assert "more than 100000" in error["message"], error
    _assert_pieces_on_the_loop_between_its_turns(log, loop_thread, at_least=3)
    assert not engine.requests


def test_a_long_array_other_than_the_prompt_is_refused_at_the_arrays_limit(monkeypatch) -> None:
    engine = FakeEngine()  # 64 tokens of context: arrays are held to protocol.MIN_ARRAY_LIMIT
    body = json.dumps({"model": MODEL, "stop_token_ids": [12] * (4 * protocol.MIN_ARRAY_LIMIT),
                       "prompt": [1], "max_tokens": 1}).encode()
    resp, _, _ = _events_while_posting(engine, body, monkeypatch)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"more than {protocol.MIN_ARRAY_LIMIT}" in error["message"]


def test_a_member_limit_holds_only_that_members_arrays() -> None:
    text = json.dumps({"stop": [1] * 50, "prompt": [[2] * 10], "n": [3] * 50})
    assert json_chunked.loads(text, None, {"prompt": 10}) == json.loads(text)
    with pytest.raises(json_chunked.TooManyItems) as refused:
        json_chunked.loads(text, None, {"prompt": 9})
    assert refused.value.member == "prompt" and refused.value.max_items == 9
    with pytest.raises(json_chunked.TooManyItems) as refused:
        json_chunked.loads(text, 40, {"prompt": 9})
    assert refused.value.member is None and refused.value.max_items == 40  # "stop" comes first


def _validator_alone(raw: bytes) -> CompletionRequest | str:
    try:
        return CompletionRequest.model_validate(json.loads(raw))
    except Exception as exc:  # noqa: BLE001 - the error's text is what is compared
        return str(exc).splitlines()[0]


def _parsed(raw: bytes) -> CompletionRequest | str:
    try:
        return parse_body(CompletionRequest, raw, max_prompt_ids=1 << 20)
    except ApiError as err:
        return err.message


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7", None, [1], protocol.INT64_MAX + 1])
@pytest.mark.parametrize("nested", [False, True])
def test_a_long_id_prompt_is_what_the_validator_makes_of_it(bad, nested) -> None:
    ids = list(range(3 * protocol.ID_CHECK_PIECE))
    good = {"model": MODEL, "prompt": [ids] if nested else ids, "max_tokens": 3, "stop_token_ids": [5]}
    raw = json.dumps(good).encode()
    assert _parsed(raw) == _validator_alone(raw)
    assert _parsed(raw).prompt == ([ids] if nested else ids)
    with_bad = ids[:-3] + [bad] + ids[-2:]
    raw = json.dumps({**good, "prompt": [with_bad] if nested else with_bad}).encode()
    refused = _parsed(raw)
    assert isinstance(refused, str) and "prompt" in refused, refused
    other_field_bad = json.dumps({**good, "max_tokens": 0}).encode()
    assert "max_tokens" in _parsed(other_field_bad)


def test_steps_stay_short_for_arrays_of_any_element() -> None:
    """A run of numbers yields after each piece of CHUNK_CHARS; other elements after ITEMS_PER_STEP."""
    for items, numbers in (([12] * 200_000, True), (["word"] * 20_000, False), ([1, "a"] * 10_000, False),
                           ([{"role": "user"}] * 5_000, False)):
        text = json.dumps({"prompt": items})
        steps = json_chunked.loads_steps(text)
        yields = 0
        while True:
            try:
                next(steps)
            except StopIteration as done:
                assert done.value == json.loads(text)
                break
            yields += 1
        bound = len(text) // json_chunked.CHUNK_CHARS if numbers else len(items) // json_chunked.ITEMS_PER_STEP
        assert yields >= bound - 1, (items[:2], yields, bound)


def test_ids_past_the_vocabulary_are_refused_naming_the_first_of_them(monkeypatch) -> None:
    engine = FakeEngine(context_tokens=1 << 20)  # its vocabulary: 256 ids
    ids = [12] * 100_000 + list(range(256, 266)) + [12]
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
    resp, _, _ = _events_while_posting(engine, body, monkeypatch)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and "[256, 257, 258, 259, 260, 261, 262, 263]" in error["message"], error
    assert not engine.requests


@pytest.mark.parametrize("cut_bytes", [0, 1, 2])
def test_a_probe_that_ends_inside_a_character_still_reads_the_text_in(cut_bytes: int) -> None:
    """The early probe looks at the body as far as it has arrived, and a socket read may end anywhere: inside a
    character of three bytes, the prefix did not decode, the probe gave up, and a text far past the context was then
    read to its end (or timed out, 408, at the body-rate deadline) instead of refused at once."""
    body = json.dumps({"model": "m", "prompt": "日本語の文章" * 2000}, ensure_ascii=False).encode()
    start = body.index("日".encode())
    prefix = body[:start + 3 * 1000 + cut_bytes]  # 1,000 whole characters, then part of the next
    head = json_chunked.finish(protocol.refuse_early_steps(prefix, 512))
    assert head is not None and head.startswith("日本語の文章") and len(head) == 1000
