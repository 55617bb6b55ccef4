"""The seed scenario's `strata-engine serve` subprocess, and what ends it when the script itself is ended."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"strata-engine: ready at (http://\S+)")
# A signal stops the running engines and waits this long before killing them: under `timeout -k 5` (the GPU
# scripts) the script itself is killed 5 s after its SIGTERM.
_STOP_WAIT_S = 4.0


class EngineProcess:
    """A `serve` subprocess: waits for the ready line, keeps its stderr tail, stops it with SIGTERM.

    It runs in a session of its own (a terminal's Ctrl-C reaches it only through this script's orderly stop), so
    a signal that ends the script must end it too: `LIVE` holds the running ones for `_stop_engines_and_exit`."""

    LIVE: set["EngineProcess"] = set()

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        EngineProcess.LIVE.add(self)
        self.url: str | None = None
        self.stderr_tail: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            match = READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-40:]

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.stderr_tail[-15:])
                raise RuntimeError(f"engine not ready (exit {self.proc.poll()}) after {timeout_s:.0f} s:\n{tail}")
        assert self.url is not None
        return self.url

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        EngineProcess.LIVE.discard(self)
        return self.proc.returncode


def _stop_engines_and_exit(signum: int, _frame: Any) -> None:
    """SIGTERM / SIGHUP / SIGINT to the script (`timeout`, a closed terminal, Ctrl-C): SIGTERM every running
    engine at once (each then exits by itself, even if this script is killed next), wait a little, and exit
    128 + the signal. An engine left behind by a timed-out run would hold the card's memory, and the next
    benchmarks would run out of it."""
    engines = list(EngineProcess.LIVE)
    for engine in engines:
        if engine.proc.poll() is None:
            engine.proc.send_signal(signal.SIGTERM)
    for engine in engines:
        try:
            engine.proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            engine.proc.kill()
    print(f"seed scenario: stopped by signal {signum}; {len(engines)} engine(s) stopped", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def stop_engines_on_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _stop_engines_and_exit)
