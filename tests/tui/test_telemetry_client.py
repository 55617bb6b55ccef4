"""The telemetry client against a real HTTP server process (tests/tui/fake_engine.py): state, SSE, resume."""

from __future__ import annotations

import json
import asyncio
import os
import subprocess

import pytest

from engine.telemetry import SwitchEvent
from strata_tui.engine_io.telemetry_client import TelemetryClient
from tests.tui.conftest import FAKE_ENGINE, FIXTURES, recorded


@pytest.fixture
def server():
    env = {**os.environ, "FAKE_ENGINE_EVENTS": str(FIXTURES / "seed_run.jsonl"), "FAKE_ENGINE_MODE": "serve"}
    proc = subprocess.Popen([*FAKE_ENGINE, "serve"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            text=True)
    url = None
    for line in proc.stdout:
        if line.startswith("strata-engine: ready at "):
            url = line.split(" at ", 1)[1].strip()
            break
    assert url, "fake engine did not print its ready line"
    yield url, proc
    proc.kill()
    proc.wait()


async def _collect(client: TelemetryClient, at_least: int, statuses=None) -> list:
    got: list = []
    stream = client.events(on_status=(lambda c, r: statuses.append((c, r))) if statuses is not None else None)
    async for batch in stream:
        got += batch
        if len(got) >= at_least:
            break
    await stream.aclose()
    return got


async def test_state_and_events_in_order(server) -> None:
    url, _ = server
    client = TelemetryClient(url)
    state = await client.state()
    assert {s["name"] for s in state["switches"]} >= {"SPLIT_ATTN", "COMPILE"}
    expected = recorded("seed_run.jsonl")
    got = await asyncio.wait_for(_collect(client, len(expected)), 10)
    assert [e.seq for e in got] == list(range(1, len(expected) + 1))
    assert [type(e) for e in got] == [type(e) for e in expected]
    await client.aclose()


async def test_resume_sends_last_event_id_and_skips_seen_events(server) -> None:
    url, _ = server
    client = TelemetryClient(url)
    first = await asyncio.wait_for(_collect(client, 10), 10)
    assert client.last_seq >= 10
    seen = client.last_seq
    result = await client.set_switch("SPLIT_ATTN", True)  # publishes a new event after the history
    assert result.ok
    more = await asyncio.wait_for(_collect(client, 1), 10)
    assert all(e.seq > seen for e in more), "a resumed stream must not repeat events"
    assert first[0].seq == 1
    await client.aclose()


async def test_control_routes_live_and_restart_only(server) -> None:
    url, _ = server
    client = TelemetryClient(url)
    live = await client.set_switch("SPLIT_ATTN", True)
    assert live.ok and live.body["switch"]["enabled"] is True
    start_only = await client.set_switch("COMPILE", True)
    assert start_only.status == 409 and "restart" in start_only.message
    reserve = await client.set_vram_reserve(1280)
    assert reserve.ok and reserve.body == {"vram_reserve_mib": 1280}
    await client.aclose()


async def test_dropped_stream_reports_status_and_retries(server) -> None:
    url, proc = server
    client = TelemetryClient(url, reconnect_s=0.05, max_reconnect_s=0.1)
    statuses: list = []
    stream = client.events(on_status=lambda c, r: statuses.append((c, r)))
    await asyncio.wait_for(stream.__anext__(), 10)
    proc.kill()
    proc.wait()

    async def drain():
        async for _ in stream:
            pass

    task = asyncio.create_task(drain())
    for _ in range(100):
        if sum(1 for c, _ in statuses if not c) >= 2:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    assert statuses[0] == (True, "connected")
    assert sum(1 for c, _ in statuses if not c) >= 2, f"expected repeated reconnect attempts, got {statuses}"
    await client.aclose()


def test_unknown_event_types_are_skipped_not_fatal() -> None:
    client = TelemetryClient("http://127.0.0.1:1")
    from strata_tui.engine_io.sse import SSEMessage
    batch = client._parse([SSEMessage("1", "x", '{"type": "from-the-future", "seq": 1}'),
                           SSEMessage("2", "switch", '{"type": "switch", "seq": 2, "name": "SPLIT_ATTN"}'),
                           SSEMessage("3", "x", "not json")])
    assert [type(e) for e in batch] == [SwitchEvent] and client.skipped_events == 2


def test_events_of_a_restarted_engine_are_not_taken_for_seen_ones() -> None:
    """After a restart the engine's seq starts at 1 again: the new epoch in the event ids says so."""
    from strata_tui.engine_io.sse import SSEMessage

    client = TelemetryClient("http://127.0.0.1:9")

    def message(epoch: str, seq: int) -> SSEMessage:
        return SSEMessage(id=f"{epoch}-{seq}", event="warning",
                          data=json.dumps({"type": "warning", "seq": seq, "message": f"{epoch}/{seq}"}))

    assert [e.seq for e in client._parse([message("100", s) for s in (1, 2, 3, 4)])] == [1, 2, 3, 4]
    assert client.last_event_id == "100-4"
    assert [e.message for e in client._parse([message("200", s) for s in (1, 2)])] == ["200/1", "200/2"]
    assert client.last_event_id == "200-2" and client.last_seq == 2
