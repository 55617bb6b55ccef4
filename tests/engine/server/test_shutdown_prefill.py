"""SIGTERM while requests prefill: the real `strata-engine serve` on CPU, twelve clients with prompts long
enough that prefill takes seconds. Every client gets the documented error (503 `shutting_down` in OpenAI's
shape) or a clean SSE end, never uvicorn's plain-text 500, and the process exits 0 well inside strata-tui's
5 s grace (the target is 3 s; the bound here is generous for a loaded machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine.cli.serve import READY_PREFIX
from tests.engine.server.ready import ready_line_url
from tests.engine.server.real import wait_until

ROOT = Path(__file__).resolve().parents[3]
CONTEXT = 16384
CLIENTS = 12
EXIT_BOUND_S = 8.0


def _answer_is_clean(status: int, text: str) -> bool:
    if status == 503:
        error = json.loads(text)["error"]
        return set(error) == {"message", "type", "param", "code"} and error["code"] == "shutting_down"
    if status == 200 and text.rstrip().endswith("data: [DONE]"):
        return '"finish_reason":"abort"' in text or '"finish_reason": "abort"' in text or "error" in text
    return False


def test_sigterm_while_prefilling_answers_every_client_and_exits_fast() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--device", "cpu", "--port", "0",
                             "--context", str(CONTEXT), "--batch", "4", "--log-level", "warning"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), (line, proc.stderr.read() if proc.poll() is not None else "")
        url = ready_line_url(line)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        answers: dict[int, tuple[int | str, str]] = {}

        def client(i: int) -> None:
            body = {"model": model, "prompt": [10 + (i * 7 + j) % 3000 for j in range(CONTEXT - 64)],
                    "max_tokens": 8, "stream": i % 2 == 0}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
                    answers[i] = (resp.status_code, resp.read().decode())
            except httpx.HTTPError as exc:
                answers[i] = (type(exc).__name__, str(exc))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()

        def prefilling() -> bool:
            state = httpx.get(url + "/strata/state", timeout=30).json()
            return state["queue"]["prefill_tokens"] > 0

        assert wait_until(prefilling, timeout_s=120, interval_s=0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        exit_s = time.monotonic() - t0
        for t in threads:
            t.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert code == 0, stderr[-2000:]
    assert exit_s < EXIT_BOUND_S, f"exit took {exit_s:.1f} s"
    assert len(answers) == CLIENTS
    unclean = {i: a for i, a in answers.items() if isinstance(a[0], str) or not _answer_is_clean(*a)}
    # A client whose request had not been read yet when the listener closed gets a refused connection: also
    # an answer a client understands, but none may get a plain-text 500.
    assert all(not (isinstance(a[0], int) and a[0] >= 500 and a[0] != 503) for a in answers.values()), answers
    assert all(isinstance(a[0], str) for a in unclean.values()), {i: (a[0], a[1][-300:]) for i, a in unclean.items()}
    assert "Traceback" not in stderr, stderr[-2000:]
