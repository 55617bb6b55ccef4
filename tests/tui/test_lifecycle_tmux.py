"""The process lifecycle in a real terminal (tmux): closing the terminal, SIGTERM, SIGINT and `q` always end
strata-tui, quickly, and take the engine it launched with it.

The engine is tests/tui/fake_engine.py (a real process with a real HTTP server) kept busy, so the app is
drawing when the terminal goes away: that is when a dead terminal used to wedge it (the output thread died
on EIO, the next write blocked the event loop forever, and the input thread spun on read(0) = 0).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.tui.test_tmux import _capture, _new_session, _wait_for

ROOT = Path(__file__).resolve().parents[2]
FAKE_ENGINE = Path(__file__).parent / "fake_engine.py"
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone_within(pids: list[int], timeout_s: float) -> float | None:
    """Seconds until every pid is gone (zombies count as gone), or None if one outlived `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Session:
    """strata-tui (the real app, engine_program = the fake engine) running under bash in a tmux window."""

    def __init__(self, tmp_path: Path, mode: str = "serve", busy: str | None = "6:30") -> None:
        self.tag = uuid.uuid4().hex[:10]
        self.name = f"strata-life-{self.tag}"
        config = tmp_path / "config"
        (config / "profiles").mkdir(parents=True)
        (config / "profiles" / "default.toml").write_text('[engine]\nmodel = "builtin:strata-tiny"\n'
                                                         'device = "cpu"\n')
        self.script = tmp_path / f"tui_{self.tag}.py"
        self.script.write_text(
            "import sys\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from strata_tui.app import create_app\n"
            f"prog = [sys.executable, {str(FAKE_ENGINE)!r}, '--tag={self.tag}']\n"
            "app = create_app(engine_program=prog, handle_signals=True, sampler_factory=None)\n"
            "app.run()\n"
            "sys.exit(app.return_code or 0)\n")
        env = f"STRATA_TUI_CONFIG_DIR={config} FAKE_ENGINE_MODE={mode} TERM=xterm-256color"
        if busy:
            env += f" FAKE_ENGINE_BUSY={busy}"
        # bash, as a person's terminal runs: on hangup it passes SIGHUP on to its jobs.
        _new_session(self.name, f"{env} {sys.executable} {self.script}; echo STRATA-TUI-EXITED $?", shell="bash")

    def tui_pids(self) -> list[int]:
        return _pids(str(self.script))

    def engine_pids(self) -> list[int]:
        return _pids(f"--tag={self.tag}")

    def wait_started(self, needles: list[str], timeout_s: float = 30) -> str:
        return _wait_for(self.name, needles, timeout_s)

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)
        for pid in self.tui_pids() + self.engine_pids():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def session_factory(tmp_path: Path):
    made: list[Session] = []

    def make(**kwargs) -> Session:
        made.append(Session(tmp_path, **kwargs))
        return made[-1]

    yield make
    for session in made:
        session.close()


def _started(session: Session, needles: list[str]) -> tuple[list[int], list[int]]:
    session.wait_started(needles)
    tui, engine = session.tui_pids(), session.engine_pids()
    assert tui, "strata-tui is not running"
    return tui, engine


@pytest.mark.parametrize("mode", ["serve", "ignore-term"])
def test_closing_the_terminal_ends_the_tui_and_its_engine_within_2_s(session_factory, mode: str) -> None:
    """ignore-term: an engine slow to stop keeps the app drawing into the dead terminal for seconds."""
    session = session_factory(mode=mode)
    tui, engine = _started(session, ["engine ready", "busy-5"])
    assert engine, "the fake engine is not running"
    time.sleep(1.0)  # let it draw for a while: the wedge needed writes after the terminal was gone
    subprocess.run(["tmux", "kill-session", "-t", session.name], check=True)
    took_s = _gone_within(tui + engine, timeout_s=6.0)
    leftover = [(p, open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:80]) for p in tui + engine if _alive(p)]
    assert took_s is not None, f"still running 6 s after the terminal closed: {leftover}"
    assert took_s <= 2.0, f"took {took_s:.2f} s to end after the terminal closed"


def test_closing_the_terminal_after_a_start_up_crash(session_factory) -> None:
    session = session_factory(mode="fail-start", busy=None)
    tui, _ = _started(session, ["exit code 2"])
    subprocess.run(["tmux", "kill-session", "-t", session.name], check=True)
    assert _gone_within(tui, timeout_s=2.0) is not None, "strata-tui outlived its terminal after a crash"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_end_it_with_a_dialog_open(session_factory, sig: signal.Signals) -> None:
    session = session_factory()
    tui, engine = _started(session, ["engine ready", "busy-5"])
    subprocess.run(["tmux", "send-keys", "-t", session.name, "?"], check=True)
    session.wait_started(["Help", "toggle switch N"])  # the help dialog is open
    os.kill(tui[0], sig)
    took_s = _gone_within(tui + engine, timeout_s=6.0)
    assert took_s is not None and took_s <= 3.0, f"{sig.name}: took {took_s} s (None = never)"
    _wait_for(session.name, ["STRATA-TUI-EXITED"], timeout_s=3)


def test_sigterm_ends_it_on_the_crash_screen(session_factory) -> None:
    session = session_factory(mode="fail-start", busy=None)
    tui, _ = _started(session, ["exit code 2"])
    os.kill(tui[0], signal.SIGTERM)
    assert _gone_within(tui, timeout_s=3.0) is not None, "SIGTERM did not end strata-tui on the crash screen"
    _wait_for(session.name, ["STRATA-TUI-EXITED"], timeout_s=3)


@pytest.mark.parametrize("mode", ["slow-term", "ignore-term"])
def test_q_gives_the_prompt_back_at_once_and_the_engine_still_ends(session_factory, mode: str) -> None:
    """slow-term: the engine takes 3 s to stop, writing log lines all the while (its pipes must stay open, and
    it is let finish); ignore-term: it never stops by itself and is SIGKILLed after the 5 s budget, with the
    app long gone."""
    session = session_factory(mode=mode)
    tui, engine = _started(session, ["engine ready", "busy-5"])
    assert engine, "the fake engine is not running"
    subprocess.run(["tmux", "send-keys", "-t", session.name, "q"], check=True)
    started = time.monotonic()
    _wait_for(session.name, ["STRATA-TUI-EXITED 0"], timeout_s=8)
    prompt_s = time.monotonic() - started
    assert prompt_s <= 2.0, f"the prompt came back {prompt_s:.2f} s after q; screen:\n{_capture(session.name)}"
    assert _gone_within(engine, timeout_s=10.0) is not None, "the engine outlived the app by 10 s"
    gone_s = time.monotonic() - started
    if mode == "slow-term":
        assert 2.5 <= gone_s <= 4.5, f"the engine ended {gone_s:.2f} s after q: killed, not let stop"
    else:
        assert 4.5 <= gone_s <= 7.0, f"the engine ended {gone_s:.2f} s after q (SIGKILL due at 5 s)"
