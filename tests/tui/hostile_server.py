"""A vLLM look-alike on loopback whose /metrics misbehaves as a hostile or broken server can: a body of tens of
MB, one that trickles a byte at a time, one that sends its head and then nothing, one with NaN, huge and
negative values; and a Strata look-alike (`STRATA_ROUTES`) whose /strata/state or /strata/events misbehaves the
same way (a state of tens of MB, an event that never ends). Raw sockets, one thread per connection, so that the
misbehaviour is exactly what is written here (a framework would buffer or time it out)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

VERSION_BODY = b'{"version": "0.10.1.1"}'
GOOD_METRICS = (
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
)
BAD_VALUES = (
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} -7.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1e300\n'
    'vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="0.1"} 2.0\n'
    'vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="+Inf"} 4.0\n'
    'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} NaN\n'
    'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.0\n'
)
DUPLICATE_LINE = b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'


def _head(length: int | None, content_type: bytes = b"text/plain; version=0.0.4") -> bytes:
    sized = b"Content-Length: %d\r\n" % length if length is not None else b""
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n" + sized + b"Connection: close\r\n\r\n"


def huge(sock: socket.socket, stop: threading.Event, mib: int = 50) -> None:
    """`mib` MiB of one series repeated: summed, it reads as a million requests running."""
    count = (mib << 20) // len(DUPLICATE_LINE)
    sock.sendall(_head(count * len(DUPLICATE_LINE)))
    block = DUPLICATE_LINE * 4096
    sent = 0
    while sent < count and not stop.is_set():
        piece = block[:min(len(block), (count - sent) * len(DUPLICATE_LINE))]
        sock.sendall(piece)
        sent += len(piece) // len(DUPLICATE_LINE)


def trickle(sock: socket.socket, stop: threading.Event) -> None:
    """A head promising a body, then a byte every 0.5 s: never silent long enough for a read timeout."""
    body = GOOD_METRICS.encode() * 1000
    sock.sendall(_head(len(body)))
    for i in range(len(body)):
        if stop.wait(0.5):
            return
        sock.sendall(body[i:i + 1])


def silent(sock: socket.socket, stop: threading.Event) -> None:
    """A head, then nothing at all."""
    sock.sendall(_head(1000))
    stop.wait(600)


def bad_values(sock: socket.socket, stop: threading.Event) -> None:
    body = BAD_VALUES.encode()
    sock.sendall(_head(len(body)) + body)


def _json(body: bytes) -> Callable[[socket.socket, threading.Event], None]:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(_head(len(body), b"application/json"))
        sock.sendall(body)  # not joined to the head: a copy would count in a test's traced memory
    return answer


SLOT = b'{"slot": 0, "state": "decode", "request_id": "r", "prefilled_tokens": 1, "generated_tokens": 1},'


def huge_state(sock: socket.socket, stop: threading.Event, mib: int = 50) -> None:
    """A /strata/state of `mib` MiB (a million slots), its length not declared: only what arrives can tell."""
    sock.sendall(_head(None, b"application/json") + b'{"slots": [')
    block, sent = SLOT * 4096, 0
    while sent < mib << 20 and not stop.is_set():
        sock.sendall(block)
        sent += len(block)
    sock.sendall(SLOT[:-1] + b"]}")


def _sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"


def quiet_events(sock: socket.socket, stop: threading.Event) -> None:
    """An idle engine's stream: a comment now and then, no events."""
    sock.sendall(_sse_head())
    while not stop.wait(1.0):
        sock.sendall(b": keep-alive\n\n")


def endless_event(sock: socket.socket, stop: threading.Event) -> None:
    """One event whose data line never ends, sent as fast as the client takes it, until it hangs up."""
    sock.sendall(_sse_head() + b'id: e-1\ndata: {"type": "engine", "seq": 1, "state": "ready"}\n\ndata: ')
    block = b"x" * (64 << 10)
    while not stop.is_set():
        sock.sendall(block)


STATE = b'{"v": 2, "model": "hostile", "instance_id": "hostile-1", "slots": []}'
STRATA_ROUTES = {b"/health": _json(b'{"status": "ready", "reason": ""}'), b"/strata/state": _json(STATE),
                 b"/strata/events": quiet_events}


class HostileServer:
    """`with HostileServer(metrics) as url:` serves /version (vLLM's) and `metrics(sock, stop)` for /metrics, and
    `routes` (path -> answer) for the paths it names; `hits` counts the requests for each path."""

    def __init__(self, metrics: Callable[[socket.socket, threading.Event], None] = bad_values,
                 routes: dict[bytes, Callable[[socket.socket, threading.Event], None]] | None = None) -> None:
        self.metrics = metrics
        self.routes = routes or {}
        self.hits: dict[bytes, int] = {}
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            path = head.split(b" ", 2)[1].split(b"?")[0]
            self.hits[path] = self.hits.get(path, 0) + 1
            if path in self.routes:
                self.routes[path](conn, self.stop)
            elif path == b"/metrics":
                self.metrics(conn, self.stop)
            elif path == b"/version":
                conn.sendall(_head(len(VERSION_BODY), b"application/json") + VERSION_BODY)
            else:
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass
        finally:
            time.sleep(0.05)
            conn.close()

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(5)
