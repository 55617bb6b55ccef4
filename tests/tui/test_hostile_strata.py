"""strata-tui's client for a Strata engine against a hostile one (tests/tui/hostile_server.py): a /strata/state of
50 MiB, one that trickles, an event whose line never ends, /health and the control routes answering megabytes.
Every read stops at its limit or deadline with the reason in words, what the app holds stays bounded (Python's
own allocations, traced), and the event stream is tried again after its back-off. The app's side, in a real
terminal, is in tests/tui/test_hostile_tmux.py."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest

from strata_tui.adapters.base import MAX_BODY_BYTES, TooLarge
from strata_tui.engine_io.sse import MAX_EVENT_CHARS
from strata_tui.engine_io.telemetry_client import TelemetryClient
from tests.tui.hostile_server import STRATA_ROUTES, HostileServer, _json, endless_event, huge_state, trickle

BOUND_MIB = 24  # what one capped read may hold: the limit, a network chunk, the joined copy


def _routes(**overrides) -> dict:
    return {**STRATA_ROUTES, **{b"/" + k.replace("__", "/").encode(): v for k, v in overrides.items()}}


async def _traced(coro) -> tuple[object, float]:
    """(result or exception, peak MiB of Python allocations while it ran)."""
    tracemalloc.start()
    try:
        try:
            result: object = await coro
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            result = exc
        return result, tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


async def test_a_50_mib_state_is_refused_at_the_limit_with_the_reason() -> None:
    with HostileServer(routes=_routes(strata__state=huge_state)) as url:
        client = TelemetryClient(url)
        try:
            result, peak_mib = await asyncio.wait_for(_traced(client.state()), 60)
        finally:
            await client.aclose()
    assert isinstance(result, TooLarge), result
    assert "/strata/state" in str(result) and f"{MAX_BODY_BYTES >> 20} MiB" in str(result)
    assert peak_mib < BOUND_MIB, f"reading a 50 MiB state held {peak_mib:.0f} MiB"


async def test_a_state_that_trickles_ends_at_the_deadline_and_says_so() -> None:
    # a byte every half second: never silent long enough for httpx's read timeout
    with HostileServer(routes=_routes(strata__state=trickle)) as url:
        client = TelemetryClient(url, state_deadline_s=2.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"no whole answer from /strata/state in 2 s"):
                await asyncio.wait_for(client.state(), 60)
            assert time.monotonic() - t0 < 30
        finally:
            await client.aclose()


async def _statuses_until(client: TelemetryClient, done, timeout_s: float = 60) -> list:
    statuses: list[tuple[bool, str]] = []

    async def follow() -> None:
        async for _ in client.events(on_status=lambda c, r: statuses.append((c, r))):
            pass

    task = asyncio.create_task(follow())
    try:
        deadline = time.monotonic() + timeout_s
        while not done(statuses) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return statuses


async def test_an_event_that_never_ends_drops_the_connection_and_it_is_tried_again() -> None:
    hostile = HostileServer(routes=_routes(strata__events=endless_event))
    with hostile as url:
        client = TelemetryClient(url, reconnect_s=0.2, max_reconnect_s=0.8)
        try:
            def dropped_twice(statuses: list) -> bool:
                return sum(1 for c, r in statuses if not c and "/strata/events" in r) >= 2

            statuses, peak_mib = await _traced(_statuses_until(client, dropped_twice))
        finally:
            await client.aclose()
    assert isinstance(statuses, list), statuses
    drops = [r for c, r in statuses if not c]
    assert len(drops) >= 2 and hostile.hits[b"/strata/events"] >= 2, statuses  # dropped, tried again, dropped
    assert drops[0] == f"/strata/events: an unended event past {MAX_EVENT_CHARS:,} characters: dropped", drops
    assert peak_mib < BOUND_MIB, f"an endless event held {peak_mib:.0f} MiB"


@pytest.mark.parametrize("route", ["health", "strata__switches__MTP"])
async def test_a_huge_answer_to_health_or_a_control_is_not_read_past_its_limit(route: str) -> None:
    huge = _json(b'{"reason": "' + b"x" * (20 << 20) + b'"}')
    with HostileServer(routes=_routes(**{route: huge})) as url:
        client = TelemetryClient(url)
        try:
            call = client.health() if route == "health" else client.set_switch("MTP", True)
            result, peak_mib = await asyncio.wait_for(_traced(call), 60)
        finally:
            await client.aclose()
    text = str(result)
    assert "too large" in text and "xxxx" not in text, text[:300]
    assert peak_mib < BOUND_MIB, f"a 20 MiB answer held {peak_mib:.0f} MiB"


async def test_a_launched_engines_health_is_read_for_its_status_only() -> None:
    # the readiness poll of a launched vLLM / SGLang / llama.cpp reads the status; a 50 MiB body is never read
    from types import SimpleNamespace

    from strata_tui.engine_io.foreign import wait_ready

    posted: list = []
    process = SimpleNamespace(pid=None, running=True, ready_url=None)
    huge = _json(b'{"status": "ok", "x": "' + b"x" * (50 << 20) + b'"}')
    with HostileServer(routes=_routes(health=huge)) as url:
        result, peak_mib = await asyncio.wait_for(
            _traced(wait_ready(posted.append, process, url, "/health", 1, lambda u, run: ("ready", u, run))), 60)
    assert result is None and posted == [("ready", url, 1)] and process.ready_url == url, (result, posted)
    assert peak_mib < BOUND_MIB, f"a 50 MiB health answer held {peak_mib:.0f} MiB"


async def test_a_strata_engine_whose_state_is_too_large_is_still_told_apart() -> None:
    # without --kind: the state route answers (more than is read), so it is a Strata engine, whose reader then
    # says what is wrong, not "answers none of /strata/state, /props, ..."
    from strata_tui.engine_io.foreign import KindsDetected, detect_kinds

    posted: list = []
    with HostileServer(routes=_routes(strata__state=huge_state)) as url:
        await asyncio.wait_for(detect_kinds(posted.append, [url]), 60)
    assert len(posted) == 1 and isinstance(posted[0], KindsDetected)
    assert posted[0].kinds == ["strata"], posted[0].reasons
