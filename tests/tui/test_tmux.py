"""A real-terminal smoke test: strata-tui under tmux with a temp config dir; the monitor's title and panels
appear, the first-run default profile is written, the embedded model's engine comes up on CPU without a switch
shown as broken, and `q` quits cleanly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _wait_for(session: str, needles: list[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = _capture(session)
        if all(n in screen for n in needles):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"never saw {needles} on screen; last capture:\n{screen}")


def _new_session(session: str, command: str, shell: str = "sh") -> None:
    """A 160x48 tmux window with a shell, then the command typed into it (as a person would). Starting the
    command with the session can race the server's first resize and leave the app at 80x24."""
    # COLUMNS/LINES may be set in this process (Textual's test harness sets them) and a tmux server started
    # from here would pass them on, overriding the real terminal size: the app would draw at 80x24.
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "48", shell], check=True,
                   env=env)
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "160", "-y", "48"], capture_output=True)
    subprocess.run(["tmux", "send-keys", "-t", session, f"unset COLUMNS LINES; {command}", "Enter"], check=True)


def test_strata_tui_in_tmux(tmp_path: Path) -> None:
    session = f"strata-tui-test-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "config"
    command = (f"cd {ROOT} && STRATA_TUI_CONFIG_DIR={config} TERM=xterm-256color {sys.executable} "
               f"-m strata_tui.cli; echo STRATA-TUI-EXITED $?; sleep 30")
    _new_session(session, command)
    try:
        screen = _wait_for(session, ["Strata", "GPUs", "Slots", "Graph cache", "Switches", "Engine log",
                                     "profile default"], timeout_s=30)
        assert "SPLIT_ATTN" in screen and "Quit" in screen
        assert (config / "profiles" / "default.toml").exists()
        # A fresh CPU machine's first screen: the CUDA-only switches that are on by default cannot run here. That
        # is said as such, not as a failure ("degraded", in red, is for a code path that broke).
        screen = _wait_for(session, ["engine ready", "PAGED_ATTN     n/a: needs a CUDA device",
                                     "PAGED_PREFILL  n/a: needs a CUDA device"], timeout_s=60)
        assert "degraded" not in screen, screen
        # KV by use (the default): the slots panel's title says what the engine's block pool holds
        _wait_for(session, ["Slots · KV pool 0 % of", "blocks: 0 used,", "free"], timeout_s=15)
        for _ in range(2):  # toggling it must not look applied, nor ask for a restart that cannot help
            subprocess.run(["tmux", "send-keys", "-t", session, "6"], check=True)
            time.sleep(1.5)
            line = next(line for line in _capture(session).splitlines() if "PAGED_ATTN" in line)
            # It says what became of the key: saved to the profile, not applied here (a CUDA-only switch on CPU).
            assert "n/a here" in line and "not applied" in line and "applied live" not in line, line
            assert "restart" not in line, line
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        _wait_for(session, ["STRATA-TUI-EXITED 0"], timeout_s=20)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_sigterm_to_the_tui_stops_the_engine_it_launched(tmp_path: Path) -> None:
    """The engine has its own session; killing the app politely must not leave it running."""
    import os
    import signal

    config = tmp_path / "config"
    profiles = config / "profiles"
    profiles.mkdir(parents=True)
    marker = tmp_path / "engine.pid"
    # The "engine" is a python that records its pid and sleeps (the serve arguments after -c are ignored).
    (profiles / "default.toml").write_text('[engine]\nmodel = "builtin:strata-tiny"\ndevice = "cpu"\n')
    session = f"strata-tui-test-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from strata_tui.app import create_app\n"
        "prog = [sys.executable, '-c', 'import os, sys, time; "
        f"open(sys.argv[1], \"w\").write(str(os.getpid())); time.sleep(600)', {str(marker)!r}]\n"
        "create_app(engine_program=prog, handle_signals=True, sampler_factory=None).run()\n")
    _new_session(session, f"STRATA_TUI_CONFIG_DIR={config} {sys.executable} {script}; sleep 30")
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the stand-in engine never started"
            time.sleep(0.1)
        engine_pid = int(marker.read_text())
        tui_pid = int(subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()[0])
        os.kill(tui_pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.killpg(engine_pid, signal.SIGKILL)
            raise AssertionError("the engine outlived the TUI")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
