"""A real-terminal smoke test: strata-tui under tmux with a temp config dir; the monitor's title and panels
appear, the first-run default profile is written, and `q` quits cleanly."""

from __future__ import annotations

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


def test_strata_tui_in_tmux(tmp_path: Path) -> None:
    session = f"strata-tui-test-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "config"
    command = (f"cd {ROOT} && STRATA_TUI_CONFIG_DIR={config} TERM=xterm-256color {sys.executable} "
               f"-m strata_tui.cli; echo STRATA-TUI-EXITED $?; sleep 30")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "48", command], check=True)
    try:
        screen = _wait_for(session, ["Strata", "GPUs", "Slots", "Graph cache", "Switches", "Engine log",
                                     "profile default"], timeout_s=30)
        assert "SPLIT_ATTN" in screen and "Quit" in screen
        assert (config / "profiles" / "default.toml").exists()
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        _wait_for(session, ["STRATA-TUI-EXITED 0"], timeout_s=20)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
