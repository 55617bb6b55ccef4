"""strata-tui in a real terminal (tmux) against hostile files and servers: a FIFO where its state file should be,
an attached server whose /metrics is tens of MB, trickles, goes silent, or holds NaN, huge and negative values, an
attached Strata engine whose /strata/state is tens of MB or whose event stream sends an event that never ends.
The app draws, says on screen what went wrong, answers `q`, and stays small (the goals: drawn within 2 s, keys
within 1 s, 200 MiB; the deadlines here are wider so that a loaded machine passes, the figures are printed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.tui.hostile_server import (STRATA_ROUTES, HostileServer, bad_values, endless_event, huge, huge_state,
                                     silent, trickle)
from tests.tui.test_tmux import _capture, _new_session, _wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
MAX_RSS_MIB = 200
EXITED = "STRATA-TUI-EXITED"


def _start(config: Path, *args: str) -> str:
    session = f"strata-hostile-{uuid.uuid4().hex[:8]}"
    command = (f"cd {ROOT} && TERM=xterm-256color {sys.executable} -m strata_tui.cli --config-dir {config} "
               f"{' '.join(args)}; echo {EXITED} $?; sleep 30")
    _new_session(session, command)
    return session


def _app_pid(config: Path) -> int | None:
    found = subprocess.run(["pgrep", "-f", f"strata_tui.cli --config-dir {config}"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def _quit_s(session: str) -> float:
    """Seconds from `q` to the shell seeing the app exit 0."""
    t0 = time.monotonic()
    subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
    _wait_for(session, [f"{EXITED} 0"], timeout_s=20)
    return time.monotonic() - t0


def _kill(session: str) -> None:
    subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_for_the_state_file_neither_blocks_the_draw_nor_the_keys(tmp_path: Path) -> None:
    config = tmp_path / "config"
    (config / "profiles").mkdir(parents=True)
    (config / "profiles" / "default.toml").write_text('[engine]\nmodel = "builtin:strata-tiny"\ndevice = "cpu"\n')
    fifo = config / "state.toml"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    session = _start(config, "--no-launch")
    try:
        _wait_for(session, ["Strata", "Slots", "profile default"], timeout_s=30)
        drawn_s = time.monotonic() - t0
        quit_s = _quit_s(session)
        print(f"FIFO state.toml: drawn {drawn_s:.2f} s after the command, q answered in {quit_s:.2f} s")
    finally:
        try:  # a reader blocked on the FIFO (the bug) is released, so the session can end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        _kill(session)


def _attached(tmp_path: Path, metrics, needles: list[str], timeout_s: float = 45, kind: str = "vllm",
              routes: dict | None = None) -> tuple[str, float, float]:
    """Attach to a hostile server; wait for `needles`; return (screen, peak RSS MiB, seconds q took)."""
    config = tmp_path / "config"
    with HostileServer(metrics, routes) as url:
        session = _start(config, "--attach", url, "--kind", kind)
        try:
            screen = _wait_for(session, needles, timeout_s=timeout_s)
            time.sleep(3)  # a few more reads of the same server
            pid = _app_pid(config)
            assert pid is not None
            peak_mib = _peak_rss_mib(pid)
            screen = _capture(session)
            quit_s = _quit_s(session)
        finally:
            _kill(session)
    return screen, peak_mib, quit_s


def test_a_huge_metrics_body_is_refused_and_the_app_stays_small_and_answers(tmp_path: Path) -> None:
    screen, peak_mib, quit_s = _attached(tmp_path, huge, ["/metrics", "MiB"])
    print(f"50 MiB /metrics: peak RSS {peak_mib:.0f} MiB, q answered in {quit_s:.2f} s")
    assert "too large" in screen or "over" in screen, screen
    assert not re.search(r"\d{1,3}(,\d{3}){2,}", screen), "a duplicate series summed into millions is shown"
    assert peak_mib <= MAX_RSS_MIB, f"peak RSS {peak_mib:.0f} MiB"
    assert quit_s < 10


@pytest.mark.parametrize("metrics", [trickle, silent], ids=["trickle", "silent"])
def test_a_metrics_read_that_never_completes_ends_and_says_so(tmp_path: Path, metrics) -> None:
    screen, _, _ = _attached(tmp_path, metrics, ["/metrics"])
    assert "not read yet" not in screen
    assert "no whole answer" in screen or "timed out" in screen, screen


def test_nan_huge_and_negative_values_are_shown_invalid_with_the_reason(tmp_path: Path) -> None:
    screen, _, _ = _attached(tmp_path, bad_values, ["invalid"])
    assert "unreachable" not in screen, screen
    assert "NaN" in screen and "1e+300" in screen and "-7" in screen, screen
    assert "0" * 30 not in screen  # 1e300 printed as a 300-digit count
    assert "up 0.10.1.1" in screen  # the endpoint answers: it is up, some of its values are not usable


@pytest.mark.parametrize("route, answer, reason", [
    (b"/strata/state", huge_state, "/strata/state answered over 4 MiB: too large to read"),
    (b"/strata/events", endless_event, "/strata/events: an unended event past 1,048,576 characters: dropped"),
], ids=["state-50-mib", "endless-event"])
def test_a_strata_engine_sending_too_much_is_dropped_with_the_reason_and_the_app_stays_small(
        tmp_path: Path, route: bytes, answer, reason: str) -> None:
    screen, peak_mib, quit_s = _attached(tmp_path, bad_values, ["reconnecting", reason], kind="strata",
                                         routes={**STRATA_ROUTES, route: answer})
    print(f"{route.decode()} hostile: peak RSS {peak_mib:.0f} MiB, q answered in {quit_s:.2f} s")
    assert "telemetry reconnecting (" + reason in screen, screen
    assert peak_mib <= MAX_RSS_MIB, f"peak RSS {peak_mib:.0f} MiB"
    assert quit_s < 10
