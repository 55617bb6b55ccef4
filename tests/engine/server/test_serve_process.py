"""The real `strata-engine serve` command (python -m engine.cli serve) on a real checkpoint, on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.cli.serve import READY_PREFIX
from tests.engine.server.ready import ready_line_url
from tests.engine.server.real import random_checkpoint
from tests.fault_injection import engine_process_env

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)


def _serve(model: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", model, "--device", "cpu", "--port", "0",
         "--batch", "2", "--context", "256", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _check_serves_then_stops(proc: subprocess.Popen) -> str:
    """Ready line -> a completion -> SIGTERM -> exit 0; returns stderr. Exactly one line ever reaches stdout."""
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX + " http://127.0.0.1:"), (line, proc.poll(), proc.stderr.read()
                                                                    if proc.poll() is not None else "")
        url = ready_line_url(line)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ready"
        _check_ready_line_states_what_was_set_up(line, httpx.get(url + "/strata/state", timeout=10).json())
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        resp = httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        with httpx.stream("GET", url + "/strata/events", timeout=30) as events:
            proc.send_signal(signal.SIGTERM)
            states = [json.loads(ln[6:]).get("state") for ln in events.iter_lines()
                      if ln.startswith("data: ") and '"type":"engine"' in ln]
        assert states[-2:] == ["stopping", "exit"], states  # the engine's goodbye reaches a live subscriber
        assert proc.wait(timeout=30) == 0
        stdout, stderr = proc.communicate()
        assert stdout == "", f"stdout must hold only the ready line, got more: {stdout!r}"
        return stderr
    finally:
        if proc.poll() is None:
            proc.kill()


def _check_ready_line_states_what_was_set_up(line: str, state: dict) -> None:
    """The ready line states the KV capacity in tokens and each device's VRAM books, as the engine's state has them
    (vLLM and llama.cpp print theirs at start-up)."""
    kv = state["kv"]
    paging = kv.get("paging")
    capacity = (paging["pool_blocks"] * paging["block_tokens"] if paging and paging["pool_blocks"]
                else kv["slots"] * kv["context_tokens"])
    assert f" · KV {capacity:,} tokens (" in line, (line, kv)
    for vram in state["vram"]:
        books = line.split(f" · {vram['device']}: ", 1)
        assert len(books) == 2, (line, vram)
        assert books[1].startswith(f"weights {vram['weights_mib']:,.0f} MiB, KV {vram['kv_mib']:,.0f} MiB"), line
        assert "reserve " in books[1] and "free " in books[1], line


def test_serve_prints_one_ready_line_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    stderr = _check_serves_then_stops(_serve(str(random_checkpoint(tmp_path))))
    assert "Traceback" not in stderr


def test_serve_builtin_strata_tiny() -> None:
    try:
        from engine.model import resolve_model_path

        resolve_model_path("builtin:strata-tiny")
    except Exception as exc:  # noqa: BLE001 - the embedded model is built by another part of the project
        pytest.skip(f"builtin:strata-tiny is not available yet: {exc}")
    _check_serves_then_stops(_serve("builtin:strata-tiny"))


def test_serve_with_a_bad_checkpoint_exits_nonzero_with_one_line(tmp_path: Path) -> None:
    proc = _serve(str(tmp_path / "missing"))
    try:
        assert proc.wait(timeout=60) == 2
        stdout, stderr = proc.communicate()
        assert stdout == ""
        errors = [ln for ln in stderr.splitlines() if ln.startswith("strata-engine serve: error:")]
        assert len(errors) == 1 and "missing" in errors[0], stderr
        assert "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.gpu
def test_sticky_cuda_error_answers_503_then_exits_nonzero(tmp_path: Path) -> None:
    """A device-side fault (injected at the first decode graph capture) kills the engine: the request in
    flight gets 503 with the real CUDA message, /health says dead, and the process exits 1."""
    ckpt = str(random_checkpoint(tmp_path))
    env = engine_process_env("capture:decode:1:sticky", {**os.environ, "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", ckpt, "--device", "cuda:0", "--port", "0",
         "--batch", "2", "--context", "256"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = ready_line_url(proc.stdout.readline())
        resp = httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": ckpt, "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert resp.status_code == 503, resp.text
        assert "illegal memory access" in resp.json()["error"]["message"]
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.gpu
def test_serve_on_cuda_exits_0_on_sigterm_after_chunks_ran_beside_a_decoding_slot(tmp_path: Path) -> None:
    """A long prompt arrives while a slot decodes, so its chunks run on the side stream (a green context where
    torch and the driver have them); then SIGTERM. The process must exit 0 with no abort: a green context
    destroyed at the interpreter's exit while torch still frees memory of its stream ends `serve` with -6
    (SIGABRT)."""
    ckpt = str(random_checkpoint(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", ckpt, "--device", "cuda:0", "--port", "0",
         "--batch", "2", "--context", "16384", "--prefill-chunk-tokens", "512"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), (line, proc.poll())
        url = ready_line_url(line)
        short = {"model": ckpt, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=short, timeout=120) as stream:
            lines = stream.iter_lines()
            assert any(ln.startswith("data: {") for ln in lines)  # the short request decodes
            long = {"model": ckpt, "prompt": [(i * 7919) % 200 + 3 for i in range(8000)], "max_tokens": 4,
                    "ignore_eos": True}
            resp = httpx.post(url + "/v1/completions", json=long, timeout=120)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text
            assert sum(1 for ln in lines if ln.startswith("data: {")) > 0
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stderr = proc.stderr.read()
        assert code == 0, stderr[-3000:]
        assert "context is destroyed" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
