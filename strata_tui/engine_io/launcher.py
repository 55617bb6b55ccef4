"""Launching `strata-engine serve` as a child process: argv (never a shell), switches in the environment.

The engine runs in its own process group (start_new_session=True) so a stop reaches every process it
started; stop is SIGTERM to the group, then SIGKILL after a timeout. stdin is closed. stdout and stderr are
read in chunks and split on \\r and \\n by `LineSplitter`, so a progress bar that redraws with \\r becomes
lines and a huge line cannot hit a reader's line-length limit. The ready line
`strata-engine: ready at http://HOST:PORT ...` is recognised here and reported through `on_ready`.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import engine
from engine.config import EngineConfig
from engine.switches import SWITCHES

# The URL is the fourth word; what the engine set up follows it (KV capacity, VRAM books).
READY_RE = re.compile(r"^strata-engine: ready at (https?://\S+)(?:\s.*)?$")
_READ_CHUNK_BYTES = 64 * 1024
_LINE_END = re.compile(r"\r\n|\r|\n")
_MAX_LINE_CHARS = 16 * 1024  # a longer line is cut into pieces of this size so the log stays bounded


API_KEY_ENV = "STRATA_API_KEY"  # what `strata-engine serve` reads when --api-key is absent


def engine_argv(config: EngineConfig, program: list[str] | None = None) -> list[str]:
    """The serve command for `config`: `python -m engine.cli serve ...` unless another program is given.
    The API key is not on it (anyone can read argv with `ps`): it travels in the environment."""
    base = program if program is not None else [sys.executable, "-m", "engine.cli"]
    return [*base, "serve", *replace(config, api_key=None).to_argv()]


def engine_env(config: EngineConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours, minus inherited switch variables, plus the profile's switches.

    Only registered switch variables are dropped: the profile decides those. Other STRATA_* settings
    (an API key, test-only fault injection) pass through untouched."""
    env = dict(os.environ if base is None else base)
    for switch in SWITCHES:
        env.pop(switch.env_var, None)
    env.update(config.switch_env())
    env.update(config.secret_env())  # the key travels in the environment, never in argv
    env.setdefault("PYTHONUNBUFFERED", "1")
    # `python -m engine.cli` must find the same engine this app imports, from whatever directory the app
    # was started in (a source checkout is not on the child's path by itself).
    source_root = str(Path(engine.__file__).resolve().parents[1])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if source_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, source_root])
    return env


class LineSplitter:
    """Turn byte chunks into text lines split on \\r\\n, \\n or \\r; undecodable bytes become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        text = self._buffer + self._decoder.decode(chunk)
        # A trailing \r may be the first half of a \r\n split across chunks: keep it for the next one.
        hold = ""
        if text.endswith("\r"):
            text, hold = text[:-1], "\r"
        lines = _LINE_END.split(text)
        self._buffer = lines.pop() + hold
        while len(self._buffer) > _MAX_LINE_CHARS:
            lines.append(self._buffer[:_MAX_LINE_CHARS])
            self._buffer = self._buffer[_MAX_LINE_CHARS:]
        if any(len(line) > _MAX_LINE_CHARS for line in lines):
            lines = [line[i:i + _MAX_LINE_CHARS] for line in lines for i in range(0, len(line) or 1, _MAX_LINE_CHARS)]
        return lines

    def flush(self) -> list[str]:
        """The last, unterminated line (at end of stream)."""
        tail = (self._buffer + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._buffer = ""
        return [tail] if tail else []


@dataclass
class ExitInfo:
    """How the engine ended: its return code and whether we asked it to stop."""

    returncode: int
    requested: bool


class EngineProcess:
    """One run of the engine. Start it, read its output, notice readiness, stop it. Not restartable:
    a restart is a new EngineProcess (fresh pipes, fresh process group)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        on_output: Callable[[str, list[str]], None],
        on_ready: Callable[[str], None],
        cwd: str | None = None,
    ) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self._on_output = on_output
        self._on_ready = on_ready
        self._proc: asyncio.subprocess.Process | None = None
        self._stop_requested = False
        self.ready_url: str | None = None
        self.why_stopped = ""  # set by whoever stops it ("you pressed s"), for the crash panel
        self.handed_off = False  # its stop was handed to a reaper process (the app is leaving without waiting)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def run(self) -> ExitInfo:
        """Start the engine, pump its output until both pipes close, and return how it exited."""
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        try:
            await asyncio.gather(self._pump(self._proc.stdout, "stdout"), self._pump(self._proc.stderr, "stderr"))
            returncode = await self._proc.wait()
        except asyncio.CancelledError:
            if self.handed_off:  # the reaper finishes the stop; the app leaves now
                raise
            try:
                await self.stop()
            finally:
                if self._proc.returncode is None:  # a second cancel cut the graceful stop short
                    self.kill_now()
            raise
        finally:
            # Close the transport while the loop still runs; left to the garbage collector it complains
            # ("Event loop is closed") when the app's loop is already gone.
            transport = getattr(self._proc, "_transport", None)
            if transport is not None:
                popen = getattr(transport, "_proc", None)
                if self.handed_off and popen is not None and popen.returncode is None:
                    # asyncio's close() SIGKILLs a child its Popen says is running; the reaper sees this one's
                    # end instead (asyncio's own exit code, from its child watcher, is kept apart).
                    popen.returncode = -signal.SIGTERM
                transport.close()
        return ExitInfo(returncode, self._stop_requested)

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        splitter = LineSplitter()
        while True:
            chunk = await stream.read(_READ_CHUNK_BYTES)
            lines = splitter.feed(chunk) if chunk else splitter.flush()
            if lines:
                self._on_output(name, lines)
            if name == "stdout" and self.ready_url is None:
                for line in lines:
                    match = READY_RE.match(line)
                    if match:
                        self.ready_url = match.group(1)
                        self._on_ready(self.ready_url)
                        break
            if not chunk:
                return

    async def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM the process group, wait up to `timeout_s`, then SIGKILL it. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        self._stop_requested = True
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        else:
            # The leader is gone; children it left in the group may not be.
            _signal_group(proc.pid, signal.SIGKILL)
        return proc.returncode

    def hand_off(self, timeout_s: float) -> None:
        """SIGTERM the group and leave the rest of the stop to `strata_tui/engine_io/reaper.py`, a process of its own
        that drains the engine's output pipes and SIGKILLs the group if it is still there after `timeout_s`:
        the app can exit at once and the engine still ends."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        self._stop_requested = self.handed_off = True
        fds = [fd for fd in (_pipe_fd(proc, 1), _pipe_fd(proc, 2)) if fd is not None]
        try:
            subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py")), str(proc.pid),
                              str(timeout_s), *map(str, fds)], pass_fds=fds, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            self.handed_off = False  # no reaper: whoever stops it must wait (kill_now at the latest)
        _signal_group(proc.pid, signal.SIGTERM)

    def kill_now(self) -> None:
        """SIGKILL the group without waiting (used when the app is exiting and cannot await)."""
        if self._proc is not None:
            self._stop_requested = True
            _signal_group(self._proc.pid, signal.SIGKILL)


def _pipe_fd(proc: asyncio.subprocess.Process, fd: int) -> int | None:
    """The read end of the child's stdout (1) or stderr (2) pipe, as this process holds it."""
    transport = getattr(proc, "_transport", None)
    pipe = transport.get_pipe_transport(fd) if transport is not None else None
    handle = pipe.get_extra_info("pipe") if pipe is not None else None
    return handle.fileno() if handle is not None else None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
