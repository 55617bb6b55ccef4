"""`strata-engine serve` process behaviour: one ready line, signals, a dead engine, binding and warnings.

These run the real `engine.cli.serve.run` in a subprocess with a scripted engine client (so they take a
second each); test_real_engine.py runs the actual `strata-engine serve` command on a real checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.cli.serve import READY_PREFIX, bind_socket, ready_url, warn_if_exposed
from engine.config import EngineConfig
from engine.errors import ConfigError
from tests.engine.server.ready import ready_line_url

ROOT = Path(__file__).resolve().parents[3]
_SCRIPT = """
import argparse, gc, sys, threading
from engine.cli.serve import add_arguments, run
from tests.engine.server.fake_engine import FakeEngine
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[2:])
die_after_s = float(sys.argv[1])
def factory(config):
    fake = FakeEngine(context_tokens=4096, token_delay_s=0.02)
    if die_after_s > 0:
        threading.Timer(die_after_s, lambda: setattr(fake, "dead_reason", "CUDA error: an illegal memory access")).start()
    return fake
code = run(args, client_factory=factory)
print(f"frozen objects: {gc.get_freeze_count()}", file=sys.stderr)
sys.exit(code)
"""


def _start(die_after_s: float = 0.0, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(die_after_s),
         "--port", "0", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _ready_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().rstrip("\n")
    assert line.startswith(READY_PREFIX + " http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    return ready_line_url(line)


def test_ready_line_then_sigterm_drains_and_exits_zero() -> None:
    proc = _start()
    try:
        url = _ready_url(proc)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        with httpx.stream("POST", url + "/v1/completions", timeout=20,
                          json={"model": "fake-model", "prompt": "x", "max_tokens": 2000, "stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert "data: [DONE]" in rest  # the running stream was aborted and ended cleanly, not cut
        assert proc.wait(timeout=20) == 0
        stdout, stderr = proc.communicate()
        assert stdout == "", "only the ready line may go to stdout"
        assert "SIGTERM" in stderr
        # the heap loaded at start is out of the collector's reach: a full collection never walks it again
        frozen = int(stderr.rpartition("frozen objects: ")[2].split()[0])
        assert frozen > 10_000, stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dead_engine_answers_503_then_exits_nonzero() -> None:
    proc = _start(1.0)
    try:
        url = _ready_url(proc)
        deadline = time.monotonic() + 10
        reason = None
        while time.monotonic() < deadline and reason is None:
            try:
                resp = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "x",
                                                                 "max_tokens": 1}, timeout=5)
            except httpx.TransportError:
                break
            if resp.status_code == 503:
                reason = resp.json()["error"]["message"]
            time.sleep(0.05)
        assert reason is not None and "illegal memory access" in reason
        assert proc.wait(timeout=20) == 1
        assert "engine is dead" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_binding_a_busy_port_names_the_address() -> None:
    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError) as info:
            bind_socket("127.0.0.1", port)
        assert f"127.0.0.1:{port}" in str(info.value)
    finally:
        taken.close()


def test_ready_url_brackets_ipv6_hosts() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert ready_url("::1", sock).startswith("http://[::1]:")
        assert ready_url("127.0.0.1", sock) == f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_exposed_bind_without_key_warns_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    warn_if_exposed(EngineConfig(host="0.0.0.0"))
    assert "WARNING" in capsys.readouterr().err
    warn_if_exposed(EngineConfig(host="0.0.0.0", api_key="k"))
    warn_if_exposed(EngineConfig(host="127.0.0.1"))
    warn_if_exposed(EngineConfig(host="localhost"))
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
