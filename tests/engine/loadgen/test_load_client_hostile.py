"""The load client against a hostile server (tests/tui/hostile_server.py, the one strata-tui's tests attach to):
a /v1/models of 50 MiB and a completion stream whose line never ends are read to their limits and no further,
and the reason is said (what strata-tui's load panel shows), while what the client holds stays bounded."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import tracemalloc

import httpx
import pytest

from engine.errors import ConfigError
from engine.loadgen.load_client import MAX_ANSWER_BYTES, MAX_LINE_CHARS, LoadClient, RequestResult, discover
from tests.tui.hostile_server import STRATA_ROUTES, HostileServer, _json

BOUND_MIB = 24


def _huge_models(sock: socket.socket, stop: threading.Event) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                 b'{"data": [{"id": "m", "x": "')
    block, sent = b"x" * (64 << 10), 0
    while sent < 50 << 20 and not stop.is_set():
        sock.sendall(block)
        sent += len(block)
    sock.sendall(b'"}]}')


def _endless_line(sock: socket.socket, stop: threading.Event) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: ")
    block = b"x" * (64 << 10)
    while not stop.is_set():
        sock.sendall(block)


async def _traced(coro):
    tracemalloc.start()
    try:
        try:
            result = await coro
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            result = exc
        return result, tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


async def test_a_50_mib_model_list_is_refused_with_the_reason() -> None:
    with HostileServer(routes={**STRATA_ROUTES, b"/v1/models": _huge_models}) as url:
        async with httpx.AsyncClient(timeout=30) as client:
            result, peak_mib = await asyncio.wait_for(_traced(discover(LoadClient(client, url, {}))), 120)
    assert isinstance(result, ConfigError), result
    assert f"/v1/models answered over {MAX_ANSWER_BYTES >> 20} MiB: not read" in str(result), str(result)[:300]
    assert peak_mib < BOUND_MIB, f"a 50 MiB model list held {peak_mib:.0f} MiB"


async def test_a_completion_stream_line_that_never_ends_is_cut_with_the_reason() -> None:
    routes = {**STRATA_ROUTES, b"/v1/models": _json(b'{"data": [{"id": "m"}]}'), b"/v1/completions": _endless_line}
    with HostileServer(routes=routes) as url:
        async with httpx.AsyncClient(timeout=30) as client:
            load = LoadClient(client, url, {})
            result = RequestResult("r", "short", 3, 4, 0.0)
            done, peak_mib = await asyncio.wait_for(
                _traced(load.complete(result, [1, 2, 3], 4, 0.0, time.perf_counter())), 120)
    assert done is None, done
    assert result.error == f"the stream sent a line past {MAX_LINE_CHARS:,} characters without ending it"
    assert peak_mib < BOUND_MIB, f"an endless stream line held {peak_mib:.0f} MiB"


@pytest.mark.parametrize("chunks", [["data: a\n", "data: b\r", "\ndata: c"], ["da", "ta: a\r\ndata: b\n\n"]])
async def test_lines_are_split_as_httpx_splits_them(chunks: list[str]) -> None:
    from engine.loadgen.load_client import _lines

    class Stream:
        async def aiter_text(self):
            for chunk in chunks:
                yield chunk

    got = [line async for line in _lines(Stream())]  # type: ignore[arg-type]
    assert [line for line in got if line] == [line for line in "".join(chunks).splitlines() if line]
