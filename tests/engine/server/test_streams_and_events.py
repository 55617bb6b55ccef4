"""Disconnects, the telemetry SSE stream and the shutdown drain, with a scripted engine client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.server import sse
from engine.server.app import create_app
from engine.telemetry import EventBus, SlotEvent, WarningEvent
from tests.engine.server.fake_engine import FakeEngine
from tests.engine.server.live import LiveServer

MODEL = FakeEngine.model_name


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _raw_request(port: int, body: dict) -> socket.socket:
    """Send a request on a raw socket, so the test can drop the connection whenever it wants."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes, timeout_s: float = 5.0) -> bytes:
    """What the socket sent until `marker` (or the timeout): the headers and the first chunk may come in
    separate segments, so one recv is not enough (it once returned the headers alone, in CI)."""
    got = b""
    deadline = time.monotonic() + timeout_s
    while marker not in got and time.monotonic() < deadline:
        data = sock.recv(4096)
        if not data:
            break
        got += data
    return got


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_mid_generation_aborts_the_request(stream: bool) -> None:
    fake = FakeEngine(context_tokens=4096, token_delay_s=0.05)
    server = LiveServer(create_app(fake, EngineConfig(device="cpu")))
    with server:
        sock = _raw_request(server.port, {"model": MODEL, "prompt": "hi", "max_tokens": 200, "stream": stream})
        assert _wait_for(lambda: len(fake.active) == 1)
        if stream:
            assert b"data: " in _read_until(sock, b"data: ")  # a first chunk arrived: we are mid-stream
        sock.close()
        assert _wait_for(lambda: not fake.active), "the engine request kept running after the client left"
        assert len(fake.aborted) == 1
        assert _wait_for(lambda: server.app.state.serving.inflight_count == 0)
        # The server is unharmed: the next request is served in full.
        ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                        timeout=10)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_every_choice_of_an_n_request(stream: bool) -> None:
    fake = FakeEngine(context_tokens=4096, token_delay_s=0.05)
    server = LiveServer(create_app(fake, EngineConfig(device="cpu")))
    with server:
        sock = _raw_request(server.port, {"model": MODEL, "prompt": "hi", "max_tokens": 200, "stream": stream,
                                          "n": 3})
        assert _wait_for(lambda: len(fake.active) == 3)
        if stream:
            assert b"data: " in _read_until(sock, b"data: ")
        sock.close()
        assert _wait_for(lambda: not fake.active), "a choice kept running after the client left"
        assert len(fake.aborted) == 3
        assert _wait_for(lambda: server.app.state.serving.inflight_count == 0)


def test_events_stream_gives_history_then_live_then_resumes() -> None:
    fake = FakeEngine()
    for i in range(3):
        fake.bus.publish(WarningEvent(where="test", message=f"early {i}"))
    with LiveServer(create_app(fake, EngineConfig(device="cpu"), keepalive_s=0.2)) as url:
        seen: list[tuple[int, str, dict]] = []
        comments: list[str] = []
        with httpx.stream("GET", url + "/strata/events", timeout=10) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            fields: dict[str, str] = {}
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith(":"):
                    comments.append(line)
                    if "keep-alive" in line and len(seen) == 3:
                        fake.bus.publish(SlotEvent(slot=2, state="decode", request_id="r1"))
                elif line == "":
                    if fields:
                        seen.append((_seq(fields["id"], fake), fields["event"], json.loads(fields["data"])))
                        fields = {}
                        if len(seen) == 4:
                            break
                else:
                    key, _, value = line.partition(": ")
                    fields[key] = value
        assert [s[0] for s in seen] == [1, 2, 3, 4]
        assert [s[1] for s in seen] == ["warning"] * 3 + ["slot"]
        assert seen[3][2]["request_id"] == "r1" and seen[3][2]["seq"] == 4
        assert any("keep-alive" in c for c in comments)
        with httpx.stream("GET", url + "/strata/events", headers={"Last-Event-ID": f"{fake.bus.epoch}-2"},
                          timeout=10) as resp:
            ids = []
            for line in resp.iter_lines():
                if line.startswith("id: "):
                    ids.append(_seq(line[4:], fake))
                if len(ids) == 2:
                    break
        assert ids == [3, 4]
        bad = httpx.get(url + "/strata/events", headers={"Last-Event-ID": "soon"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        with httpx.stream("GET", url + "/strata/events", headers={"Last-Event-ID": "-1"}, timeout=10) as negative:
            assert negative.status_code == 400, "Last-Event-ID -1 was read as 1"
        accented = httpx.get(url + "/strata/events", headers={"Last-Event-ID": "é-1".encode()}, timeout=10)
        assert accented.status_code == 400
        assert "é-1" in accented.json()["error"]["message"], accented.json()  # as sent, not mojibake


async def test_slow_subscriber_loses_oldest_events_with_a_count_and_never_blocks_the_publisher() -> None:
    bus = EventBus(history=8)
    stopping = asyncio.Event()
    stream = sse.event_stream(bus, None, stopping, keepalive_s=5, max_queue=4)
    assert (await anext(stream)).startswith(": strata telemetry")
    started = time.perf_counter()
    for i in range(100):  # nobody reads meanwhile: the publisher must not wait
        bus.publish(WarningEvent(message=str(i)))
    assert time.perf_counter() - started < 1.0
    first = await anext(stream)
    assert first.startswith(": dropped 96"), first
    batch = await anext(stream)
    assert _ids(batch) == [f"{bus.epoch}-{n}" for n in (97, 98, 99, 100)]
    stopping.set()
    assert [piece async for piece in stream] == []


async def test_resume_past_the_history_ring_reports_the_gap() -> None:
    bus = EventBus(history=4)
    for i in range(10):
        bus.publish(WarningEvent(message=str(i)))
    stream = sse.event_stream(bus, sse.EventId(bus.epoch, 2), asyncio.Event(), keepalive_s=5)
    await anext(stream)
    gap = await anext(stream)
    assert gap == ": gap: events 3..6 are no longer kept\n\n"
    await stream.aclose()


def test_shutdown_aborts_running_streams_and_ends_event_streams() -> None:
    fake = FakeEngine(context_tokens=4096, token_delay_s=0.05)
    server = LiveServer(create_app(fake, EngineConfig(device="cpu")))
    results: dict[str, object] = {}

    def consume(name: str, method: str, path: str, body: dict | None) -> None:
        with httpx.stream(method, server.url + path, json=body, timeout=20) as resp:
            results[name] = list(resp.iter_lines())

    with server:
        threads = [
            threading.Thread(target=consume, args=("gen", "POST", "/v1/completions",
                                                   {"model": MODEL, "prompt": "x", "max_tokens": 400,
                                                    "stream": True})),
            threading.Thread(target=consume, args=("events", "GET", "/strata/events", None)),
        ]
        for t in threads:
            t.start()
        assert _wait_for(lambda: len(fake.active) == 1)
        serving = server.app.state.serving
        asyncio.run_coroutine_threadsafe(serving.shutdown(), server.loop).result(5)
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "a stream kept its connection open through shutdown"
        assert fake.aborted and not fake.active
        assert results["gen"][-2:] == ["data: [DONE]", ""] or results["gen"][-1] == "data: [DONE]"
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"


async def test_a_bare_seq_ahead_of_the_engine_replays_the_new_history() -> None:
    bus = EventBus()
    for i in range(3):
        bus.publish(WarningEvent(message=str(i)))
    stream = sse.event_stream(bus, sse.parse_last_event_id("5000"), asyncio.Event(), keepalive_s=5)
    await anext(stream)
    assert "restarted" in await anext(stream)
    batch = await anext(stream)
    assert _ids(batch) == [f"{bus.epoch}-{n}" for n in (1, 2, 3)]
    await stream.aclose()


def test_resume_across_an_engine_restart_is_detected_and_replayed() -> None:
    """The silent case: the new process has already published more events than the client had seen, so a
    bare seq would look like a plain resume and skip the new engine's first events. The epoch tells."""
    first = FakeEngine()
    for i in range(3):
        first.bus.publish(WarningEvent(message=f"old {i}"))
    with LiveServer(create_app(first, EngineConfig(device="cpu"))) as url:
        with httpx.stream("GET", url + "/strata/events", timeout=10) as resp:
            ids = []
            for line in resp.iter_lines():
                if line.startswith("id: "):
                    ids.append(line[4:])
                if len(ids) == 3:
                    break
    last_id = ids[-1]
    assert last_id == f"{first.bus.epoch}-3"
    restarted = FakeEngine()  # the engine process after a restart: seq starts at 1 again
    for i in range(6):
        restarted.bus.publish(WarningEvent(message=f"new {i}"))
    with LiveServer(create_app(restarted, EngineConfig(device="cpu"))) as url:
        lines = []
        with httpx.stream("GET", url + "/strata/events", headers={"Last-Event-ID": last_id}, timeout=10) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and '"new 5"' in line:
                    break
    assert any(line.startswith(": ") and "restarted" in line for line in lines), lines
    replayed = [json.loads(line[6:])["message"] for line in lines if line.startswith("data: ")]
    assert replayed == [f"new {i}" for i in range(6)]  # nothing of the new engine skipped


def _ids(batch: str) -> list[str]:
    return [line[4:] for line in batch.splitlines() if line.startswith("id: ")]


def _seq(event_id: str, fake: FakeEngine) -> int:
    epoch, _, seq = event_id.rpartition("-")
    assert epoch == fake.bus.epoch
    return int(seq)


def test_the_state_names_the_engine_process_that_answers() -> None:
    """A monitor reconnecting to the same address tells another engine process from the one it followed by
    `instance_id`, the epoch its event ids carry."""
    first, second = FakeEngine(), FakeEngine()
    with LiveServer(create_app(first, EngineConfig(device="cpu"))) as url:
        state = httpx.get(url + "/strata/state", timeout=10).json()
    assert state["instance_id"] == first.bus.epoch
    with LiveServer(create_app(second, EngineConfig(device="cpu"))) as url:
        assert httpx.get(url + "/strata/state", timeout=10).json()["instance_id"] == second.bus.epoch
    assert first.bus.epoch != second.bus.epoch
