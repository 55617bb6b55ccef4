"""The engine tells its log what it tells the TUI (issue 15, item 4): `serve` in a subprocess, telemetry
warnings and errors published on its bus, its stderr read back."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.engine.server.ready import ready_line_url
from engine.server.logs import EventLogger
from engine.telemetry import ErrorEvent, EventBus, GraphEvent, SwitchEvent, VramEvent, WarningEvent

ROOT = Path(__file__).resolve().parents[3]
_SCRIPT = """
import argparse, sys, threading
from engine.cli.serve import add_arguments, run
from engine.telemetry import ErrorEvent, GraphEvent, SwitchEvent, VramEvent, WarningEvent
from tests.engine.server.fake_engine import FakeEngine
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
def factory(config):
    fake = FakeEngine(context_tokens=4096)
    bus = fake.bus
    bus.publish(VramEvent(device="cuda:0", total_mib=143771, free_mib=1295.0))
    bus.publish(GraphEvent(action="retry", kind="verify", key="b8", mib=1024, device="cuda:0",
                           error="CUDA error: out of memory"))
    bus.publish(GraphEvent(action="fail", kind="draft_round", key="b6", mib=512, device="cuda:0",
                           error="CUDA error: out of memory (tried to allocate 512.00 MiB)"))
    bus.publish(GraphEvent(action="capture", kind="decode", key="b1", mib=3, device="cuda:0"))
    bus.publish(SwitchEvent(name="SPLIT_ATTN", state="degraded", reason="graph capture failed twice"))
    bus.publish(WarningEvent(where="engine.mtp", message="MTP drafting turned off for the rest of the run"))
    bus.publish(ErrorEvent(where="engine.step", exc_type="RuntimeError", message="CUDA error: misaligned address",
                           vram_free_mib=2048.0))
    return fake
sys.exit(run(args, client_factory=factory))
"""


def test_serve_logs_every_warning_and_error_event_once_and_quiets_monitoring_access() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = ready_line_url(proc.stdout.readline())
        for path in ("/health", "/metrics", "/strata/state"):
            assert httpx.get(url + path, timeout=10).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2},
                          timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = stderr.splitlines()
    events = [ln for ln in lines if " strata.events: " in ln]
    assert len(events) == 5, stderr  # retry, fail, degraded switch, warning, error; not the capture
    assert any(" WARNING " in ln and "graph retry verify b8" in ln and "VRAM free 1295 MiB" in ln for ln in events)
    assert any(" ERROR " in ln and "graph fail draft_round b6" in ln and "tried to allocate 512.00 MiB" in ln
               and "VRAM free 1295 MiB" in ln for ln in events)
    assert any(" WARNING " in ln and "switch SPLIT_ATTN degraded: graph capture failed twice" in ln for ln in events)
    assert any(" WARNING " in ln and "MTP drafting turned off" in ln for ln in events)
    assert any(" ERROR " in ln and "CUDA error: misaligned address; VRAM free 2048 MiB" in ln for ln in events)
    access = [ln for ln in lines if "uvicorn.access" in ln]
    assert any("POST /v1/completions" in ln for ln in access), stderr
    assert not any(p in ln for ln in access for p in ("/health", "/metrics", "/strata/state")), access


def test_event_logger_lines_without_vram_books(caplog) -> None:
    bus = EventBus()
    logger = EventLogger(bus)
    with caplog.at_level(logging.DEBUG, logger="strata.events"):
        for event in (GraphEvent(action="wait", kind="decode", key="b4", mib=64.0), VramEvent(device="cpu"),
                      SwitchEvent(name="SPLIT_ATTN", state="on")):
            bus.publish(event)
        logger.stop()  # logs what is queued
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "graph wait decode b4 (64 MiB)")]
