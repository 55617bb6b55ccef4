"""What a hostile client can hold of the server, with raw sockets on loopback against the server's own uvicorn
settings (engine.server.uvicorn_server.server_config): a chunked body past the limit is answered 413 and the
server stops reading it; a body trickled too slowly is answered 408, however steadily it trickles; /health is
answered 200 while more connections than the limit are open; a request head past its limit is refused whole.
Timeouts are shortened for the test where waiting for the real ones would only make it slower."""

from __future__ import annotations

import json
import resource
import socket
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.server import guard, uvicorn_server
from engine.server.app import create_app
from tests.engine.server.fake_engine import FakeEngine
from tests.engine.server.live import LiveServer
from tests.engine.server.ready import ready_line_url

BOUND_S = 20.0  # generous: the shortened timeouts are about 1 s
POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def _serve(engine: FakeEngine, **config) -> LiveServer:
    app = create_app(engine, EngineConfig(device="cpu", **config))
    return LiveServer(app, config=uvicorn_server.server_config(app))


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=BOUND_S)
    return sock


def _response_head(sock: socket.socket, deadline_s: float = BOUND_S) -> bytes:
    """The bytes read until a response head is complete (or the deadline, or the connection ends)."""
    data, end = b"", time.monotonic() + deadline_s
    while b"\r\n\r\n" not in data and time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


def test_a_chunked_body_past_the_limit_is_413_and_the_server_stops_reading_it() -> None:
    """Chunks pushed in a loop past --max-body-mib: the 413 comes, and the connection is closed soon after, so
    the sender cannot go on pushing gigabytes into a server that reads and drops them."""
    with _serve(FakeEngine(), max_body_mib=1) as url:
        sock = _connect(url)
        sock.sendall(POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (64 << 10, b"1" * (64 << 10))
        answered: list[bytes] = []
        reader = threading.Thread(target=lambda: answered.append(_response_head(sock, 60)), daemon=True)
        reader.start()
        sent, refused_at, closed = 0, None, False
        deadline = time.monotonic() + 60
        sock.settimeout(2.0)
        while time.monotonic() < deadline:
            try:
                sock.sendall(chunk)
            except socket.timeout:
                if refused_at is not None:  # the server stopped taking bytes
                    closed = True
                    break
                continue
            except OSError:  # reset / broken pipe: the server closed it
                closed = True
                break
            sent += len(chunk)
            if answered and refused_at is None:
                refused_at = sent
        reader.join(5)
        sock.close()
    assert answered and answered[0].startswith(b"HTTP/1.1 413"), answered[:1]
    assert closed, f"the server kept reading: {sent >> 20} MiB sent after {refused_at} bytes were refused"
    assert sent - (refused_at or 0) < 64 << 20, f"{(sent - refused_at) >> 20} MiB more were taken after the 413"
    assert b"connection: close" in answered[0].lower(), answered[0]


@pytest.fixture
def short_body_deadline(monkeypatch):
    monkeypatch.setattr(guard, "BODY_BASE_S", 1.0, raising=False)
    monkeypatch.setattr(guard, "BODY_STALL_S", 5.0)


def test_a_body_trickled_too_slowly_is_408_though_it_never_stalls(short_body_deadline) -> None:
    """A byte every 0.3 s never stalls for BODY_STALL_S, but the whole body must come at a minimum rate."""
    with _serve(FakeEngine()) as url:
        sock = _connect(url)
        sock.sendall(POST_HEAD + b"Content-Length: 100000\r\n\r\n")
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.3):
                try:
                    sock.sendall(b" ")
                except OSError:
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        t0 = time.monotonic()
        data = _response_head(sock, 30)
        took_s = time.monotonic() - t0
        stop.set()
        sender.join(5)
        sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:300]
    assert took_s < 15, took_s
    assert b"body_timeout" in data or b"connection: close" in data.lower()


def _open_trickling(url: str, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = _connect(url)
        sock.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n{\"model\":")
        socks.append(sock)
    return socks


def test_health_is_200_on_every_probe_with_more_connections_open_than_the_limit(monkeypatch) -> None:
    """1,030 connections each holding a half-sent body (past the 1,024 limit): a liveness probe that got 503
    would restart a healthy engine, so /health is answered whatever the other connections do; other routes
    get a JSON 503 with Retry-After."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * 1030 + 200:
        want = min(hard, 4096)
        if want < 2 * 1030 + 200:
            pytest.skip(f"needs {2 * 1030 + 200} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    monkeypatch.setattr(guard, "BODY_BASE_S", 300.0, raising=False)  # the bodies stay open however long opening 1,030 takes
    live = _serve(FakeEngine())
    with live as url:
        socks = _open_trickling(url, 1030)
        try:
            deadline = time.monotonic() + 30
            while len(live.server.server_state.connections) < 1030 and time.monotonic() < deadline:
                time.sleep(0.05)
            statuses = []
            for _ in range(17):
                probe = _connect(url)
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                statuses.append(_response_head(probe)[:12])
                probe.close()
            other = _connect(url)
            other.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            refused = _response_head(other)
            other.close()
            open_now = len(live.server.server_state.connections)
        finally:
            for sock in socks:
                sock.close()
    assert statuses == [b"HTTP/1.1 200"] * 17, statuses
    assert open_now >= 1030  # the probes were answered while every trickling connection was still open
    head = refused.split(b"\r\n\r\n")[0].lower()
    assert refused.startswith(b"HTTP/1.1 503") and b"retry-after" in head, refused[:400]
    assert b"application/json" in head


def test_a_request_head_past_64_kib_is_refused_even_in_one_packet() -> None:
    """h11 bounds only a head that is still incomplete: one that arrived whole was served."""
    with _serve(FakeEngine()) as url:
        sock = _connect(url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n")
        data = _response_head(sock)
        sock.close()
    # 431 from the guard when the head arrives in one read; h11's own 400 when it arrives in pieces (a loaded
    # machine's loopback may split it)
    assert data.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), data[:200]


def test_a_refused_content_length_body_is_drained_then_the_connection_closes() -> None:
    """A body answered before it was all read (here 401, no key) is not handed to the app: the client still
    sends all of it, reads the answer (no reset), and the connection is then closed, not kept for requests
    the server would have taken for body bytes."""
    with _serve(FakeEngine(), api_key="k") as url:
        body = json.dumps({"model": "m", "prompt": "x" * (2 << 20)}).encode()
        sock = _connect(url)
        sock.sendall(POST_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        data, end = b"", time.monotonic() + BOUND_S
        while time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
    assert data.startswith(b"HTTP/1.1 401"), data[:200]
    assert b"connection: close" in data.lower()


def test_a_real_server_under_a_1024_open_files_limit_answers_health_past_1030_connections() -> None:
    """A stock account's soft limit of 1,024 open files: the server raises it itself, so with 1,030 connections
    each holding a half-sent body it still accepts and answers /health (before, accept() failed: EMFILE)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit is {hard}")
    if soft < 2 * 1030 + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--device", "cpu", "--port", "0",
                             "--log-level", "warning"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, preexec_fn=low_limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    socks: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        url = ready_line_url(line)
        assert url, line
        socks = _open_trickling(url, 1030)
        statuses = []
        for _ in range(5):
            probe = _connect(url)
            probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            statuses.append(_response_head(probe)[:12])
            probe.close()
        assert statuses == [b"HTTP/1.1 200"] * 5, statuses
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        proc.wait(30)
