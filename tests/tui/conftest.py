"""Shared pieces of the TUI tests: a temp config dir, the recorded telemetry, an offline app."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest

from engine.telemetry import Event, event_from_json
from strata_tui.app import StrataApp, create_app

FIXTURES = Path(__file__).parent / "fixtures"


def recorded(name: str) -> list[Event]:
    """Events of a recorded run (tests/tui/fixtures/*.jsonl, written by make_fixtures.py)."""
    with open(FIXTURES / name) as handle:
        return [event_from_json(json.loads(line)) for line in handle if line.strip()]


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config"
    monkeypatch.setenv("STRATA_TUI_CONFIG_DIR", str(path))
    return path


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local time = UTC, so the clock columns of snapshots do not depend on the machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@contextlib.contextmanager
def fixed_config_dir(path: Path) -> Iterator[Path]:
    """A config folder at a fixed path (snapshots show it), empty for one test at a time: xdist's workers take
    turns on an exclusive lock beside it, so one worker's clean-up never deletes another's profiles mid-test."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            shutil.rmtree(path, ignore_errors=True)
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


def offline_app(config_dir: Path, **options) -> StrataApp:
    """The real app with no engine launched and no NVML thread (tests feed it messages)."""
    options.setdefault("launch", False)
    options.setdefault("sampler_factory", None)
    return create_app(config_dir=config_dir, **options)


def env_without_switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}


FAKE_ENGINE = [__import__("sys").executable, str(Path(__file__).parent / "fake_engine.py")]


def fake_engine_app(config_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str = "serve",
                    events: str | None = "seed_run.jsonl", **options) -> StrataApp:
    """The real app launching tests/tui/fake_engine.py (a real process with a real HTTP server)."""
    monkeypatch.setenv("FAKE_ENGINE_MODE", mode)
    if events:
        monkeypatch.setenv("FAKE_ENGINE_EVENTS", str(FIXTURES / events))
    else:
        monkeypatch.delenv("FAKE_ENGINE_EVENTS", raising=False)
    options.setdefault("sampler_factory", None)
    options.setdefault("stop_timeout_s", 2.0)
    return create_app(config_dir=config_dir, engine_program=FAKE_ENGINE, **options)


async def wait_for(pilot, condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Let the app run until `condition()` holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await pilot.pause(0.05)


def screen_text(app) -> str:
    """What the terminal shows now, as plain text (rendered the way export_screenshot renders it)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()
