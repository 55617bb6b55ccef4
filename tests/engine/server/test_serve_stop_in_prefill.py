"""`s` in strata-tui during a long prefill: SIGTERM to `strata-engine serve` ends it cleanly (exit 0) soon
after the chunk in flight, well inside the 5 s a supervisor gives a stop before SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.cli.serve import READY_PREFIX
from tests.engine.server.ready import ready_line_url

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(240)


def test_sigterm_during_a_long_prefill_exits_0_soon_after_the_server_finishes() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", "builtin:strata-tiny", "--device", "cpu",
         "--port", "0", "--context", "16384"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    stderr: list[tuple[float, str]] = []
    threading.Thread(target=lambda: stderr.extend((time.monotonic(), line) for line in proc.stderr),
                     daemon=True).start()
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), (line, proc.poll())
        url = ready_line_url(line)

        def long_prompt() -> None:
            body = {"model": "builtin:strata-tiny", "prompt": [7] * 12000, "max_tokens": 4, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                    for _ in response.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        threading.Thread(target=long_prompt, daemon=True).start()
        time.sleep(4.0)  # a few chunks into a prefill that takes far longer on CPU
        os.killpg(proc.pid, signal.SIGTERM)
        returncode = proc.wait(timeout=60)
        exited = time.monotonic()
        assert returncode == 0, [text for _, text in stderr[-10:]]
        finished = [t for t, text in stderr if "Finished server process" in text]
        assert finished, [text for _, text in stderr[-10:]]
        # After the server's last line the process only has to leave: not walk its heap for seconds.
        assert exited - finished[-1] <= 3.0, f"{exited - finished[-1]:.2f} s from the server's end to the exit"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

