"""Connections that misbehave, with raw sockets on loopback against the server's own uvicorn settings
(engine.server.uvicorn_server.server_config): a connection that sends nothing or half a request head is
closed, a body that stops arriving gets 408, a client that drops mid-upload is one INFO line (no traceback),
and a streaming client that stops reading has its generation aborted. Timeouts are shortened for the test."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from engine.config import EngineConfig
from engine.server import guard, uvicorn_server
from engine.server.app import create_app
from tests.engine.server.fake_engine import FakeEngine
from tests.engine.server.live import LiveServer
from tests.engine.server.real import wait_until

MODEL = FakeEngine.model_name
BOUND_S = 15.0  # generous: the shortened timeouts are 1 s


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(uvicorn_server, "HEADER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(guard, "BODY_STALL_S", 1.0)
    monkeypatch.setattr(guard, "SEND_STALL_S", 1.0)


def _serve(engine: FakeEngine) -> LiveServer:
    app = create_app(engine, EngineConfig(device="cpu"))
    return LiveServer(app, config=uvicorn_server.server_config(app))


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.settimeout(BOUND_S + 5)
    return sock


def _closed_within(sock: socket.socket, bound_s: float) -> tuple[bool, bytes]:
    t0 = time.monotonic()
    data = b""
    while time.monotonic() - t0 < bound_s:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return True, data
        except socket.timeout:
            return False, data
        if not chunk:
            return True, data
        data += chunk
    return False, data


def test_a_connection_that_sends_nothing_or_half_a_head_is_closed(short_timeouts) -> None:
    with _serve(FakeEngine()) as url:
        idle = _connect(url)
        half = _connect(url)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        for sock in (idle, half):
            closed, _ = _closed_within(sock, BOUND_S)
            assert closed
            sock.close()


def test_a_body_that_stops_arriving_is_408(short_timeouts) -> None:
    with _serve(FakeEngine()) as url:
        sock = _connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        _, data = _closed_within(sock, BOUND_S)
        sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:300]
        assert json.loads(body)["error"]["code"] == "body_timeout"


def test_a_client_that_drops_mid_upload_is_one_info_line(caplog) -> None:
    caplog.set_level(logging.INFO)
    with _serve(FakeEngine()) as url:
        sock = _connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\":")
        time.sleep(0.3)
        sock.close()
        assert wait_until(lambda: any("before its body was read" in r.getMessage() for r in caplog.records),
                          timeout_s=BOUND_S)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


def test_a_streaming_client_that_stops_reading_is_aborted(short_timeouts) -> None:
    engine = FakeEngine(context_tokens=1 << 20)
    with _serve(engine) as url:
        sock = _connect(url, rcvbuf=4096)
        body = json.dumps({"model": MODEL, "prompt": "x" * 64, "max_tokens": 500_000, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # Never read: the socket buffers fill, uvicorn's send blocks, the guard gives up and the request ends.
        assert wait_until(lambda: engine.aborted, timeout_s=60), "generation went on for a client that stopped reading"
        sock.close()


def test_a_token_id_body_past_the_context_is_refused_before_its_end_and_its_rest_dropped_unparsed(
        short_timeouts, monkeypatch) -> None:
    """A large body whose first bytes already hold more ids than the context is answered 400 without the app
    reading the rest; the rest is dropped as it arrives, never handed to h11, the client (which sends the whole
    body before it reads) gets the whole answer, not a reset, and the connection then closes: it cannot serve
    on without parsing the rest."""
    import h11

    from engine.server import app as app_module

    into_h11: list[int] = []
    real_receive = h11.Connection.receive_data

    def counted(self, data: bytes) -> None:
        into_h11.append(len(data))
        real_receive(self, data)

    monkeypatch.setattr(h11.Connection, "receive_data", counted)
    reads: list[int] = []
    real_refuse = app_module.refuse_early_steps
    monkeypatch.setattr(app_module, "refuse_early_steps",
                        lambda prefix, limit: (reads.append(len(prefix)), real_refuse(prefix, limit))[1])
    with _serve(FakeEngine()) as url:
        body = json.dumps({"model": MODEL, "prompt": [12] * (1 << 20), "max_tokens": 1}).encode()
        sock = _connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = _read_response(sock)
        closed, _ = _closed_within(sock, BOUND_S)
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"context_length_exceeded" in answer, answer[:300]
    assert b"connection: close" in answer.lower()
    assert closed
    assert reads and reads[-1] < len(body) // 4, reads  # refused from a prefix of the body
    assert sum(into_h11) < len(body) // 2, f"h11 took {sum(into_h11)} of the body's {len(body)} bytes"


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a whole response: {data[:300]!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed inside a response: {head[:300]!r}"
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_a_large_body_trickled_in_does_not_hold_the_others(short_timeouts, monkeypatch) -> None:
    """Large bodies are read one at a time, but one whose sender trickles it (a byte now and then, never long
    enough to stall) holds the turn only LARGE_BODY_TURN_WAIT_S for the bodies behind it."""
    import threading

    from engine.server import app as app_module

    monkeypatch.setattr(app_module, "LARGE_BODY_TURN_WAIT_S", 0.5)
    with _serve(FakeEngine()) as url:
        big = json.dumps({"model": MODEL, "prompt": [12] * (1 << 20), "max_tokens": 1}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(big)).encode() + b"\r\n\r\n")
        slow, stop = _connect(url), threading.Event()
        slow.sendall(head + big[:300_000])  # past LARGE_BODY_BYTES: it takes the turn, then trickles

        def trickle() -> None:
            for i in range(300_000, len(big)):
                if stop.wait(0.2):
                    return
                slow.sendall(big[i:i + 1])

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        time.sleep(0.5)
        fast = _connect(url)
        fast.sendall(head + big)
        answer = _read_response(fast)
        assert answer.startswith(b"HTTP/1.1 400") and b"context_length_exceeded" in answer, answer[:300]
        assert sender.is_alive()  # answered while the trickled body still held the turn
        stop.set()
        sender.join()
        for sock in (slow, fast):
            sock.close()
