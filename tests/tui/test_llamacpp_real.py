"""strata-tui against a real llama.cpp `llama-server` (built from source by scripts/build_llama_server.sh) on
a tiny random GGUF written by the `gguf` package: launch from a profile, readiness, slots and metrics on
screen after a request, stop and restart, kill -9 in the crash panel, attach with detection, the bench scenario.

    scripts/build_llama_server.sh && pytest -m llamacpp tests/tui/test_llamacpp_real.py

Skipped when no llama-server is found ($STRATA_LLAMA_SERVER, the build cache, then PATH)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.tui.conftest import offline_app, screen_text, wait_for
from tests.tui.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.llamacpp
SIZE = (160, 48)


def find_llama_server() -> str | None:
    if os.environ.get("STRATA_LLAMA_SERVER"):
        return os.environ["STRATA_LLAMA_SERVER"]
    cache = Path(os.environ.get("STRATA_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                            Path.home() / ".cache") / "strata")
    built = sorted(cache.glob("llama-server/*/bin/llama-server"))
    return str(built[-1]) if built else shutil.which("llama-server")


LLAMA_SERVER = find_llama_server()
if LLAMA_SERVER is None:
    pytest.skip("no llama-server: run scripts/build_llama_server.sh (or set STRATA_LLAMA_SERVER)",
                allow_module_level=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def write_profile(config_dir: Path, model: Path, port: int, **options) -> None:
    (config_dir / "profiles").mkdir(parents=True, exist_ok=True)
    lines = ['[engine]', 'kind = "llamacpp"', f'model = "{model}"', f'program = ["{LLAMA_SERVER}"]',
             f'port = {port}', 'threads = 1', *[f"{k} = {v}" for k, v in options.items()]]
    (config_dir / "profiles" / "ll.toml").write_text("\n".join(lines) + "\n")


async def generate(url: str, max_tokens: int = 64, prompt: str = "hello " * 40) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post("/completion", json={"prompt": prompt, "n_predict": max_tokens,
                                                           "temperature": 0, "ignore_eos": True})
        response.raise_for_status()
        return response.json()


async def test_launch_slots_metrics_then_kill_9_in_the_crash_panel(config_dir: Path, tiny_gguf: Path) -> None:
    port = free_port()
    write_profile(config_dir, tiny_gguf, port, parallel=2, ctx_size=2048)
    app = offline_app(config_dir, profile="ll", launch=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.monitor.engine_state == "ready", timeout_s=60, what="/health 200")
        assert app.process.argv[:3] == [LLAMA_SERVER, "-m", str(tiny_gguf)]
        ends = lambda: app.view.foreign.endpoints  # noqa: E731
        await wait_for(pilot, lambda: app.view.foreign and ends()[0].reachable and ends()[0].slots,
                       timeout_s=30, what="slots read")
        assert len(ends()[0].slots) == 2 and all(1024 <= s.context_tokens <= 2048 for s in ends()[0].slots)
        result = await generate(f"http://127.0.0.1:{port}")
        assert result["tokens_predicted"] == 64
        # the tiny model decodes thousands of tokens a second: what stays after the request is the slot's cache
        # (prompt + generated) and the counters; live counts are zeroed when a slot is released
        held = result["tokens_evaluated"] + result["tokens_predicted"] - 1
        await wait_for(pilot, lambda: any(s.held_tokens == held for s in ends()[0].slots or ()),
                       timeout_s=30, what=f"a slot holding {held} tokens")
        await wait_for(pilot, lambda: ends()[0].decode_tokens_s is not None and ends()[0].prefix_hit is not None,
                       timeout_s=30, what="metrics")
        assert ends()[0].running == 0 and ends()[0].waiting == 0
        app.screen.redraw(force=True)
        await pilot.pause()
        text = screen_text(app)
        assert "llama.cpp · 1 endpoint" in text and f"127.0.0.1:{port}" in text and "slot  state" in text
        assert re.search(rf"\bidle\b.*\b{held}\b", text), text  # the slot's held tokens on screen
        assert "llama.cpp exports no latency histograms" in text
        assert "Engine log" in text and "load_model" in "\n".join(line for _, line in app.view.log_lines)
        await pilot.press("s")  # SIGTERM to its group: llama-server ends cleanly
        await wait_for(pilot, lambda: app.view.crash is not None, timeout_s=20, what="the stop")
        assert app.view.crash.requested and app.view.crash.why_stopped == "you pressed s"
        first_pid = app.process.pid
        await pilot.press("r")
        await wait_for(pilot, lambda: app.process.pid != first_pid and app.view.monitor.engine_state == "ready"
                       and app.view.crash is None and ends()[0].reachable, timeout_s=60, what="the restart")
        os.killpg(app.process.pid, signal.SIGKILL)
        await wait_for(pilot, lambda: app.view.crash is not None, timeout_s=20, what="the crash panel")
        app.screen.redraw(force=True)
        await pilot.pause()
        assert "engine killed by SIGKILL" in screen_text(app)
        await wait_for(pilot, lambda: not ends()[0].reachable, timeout_s=10, what="the endpoint marked down")
        assert ends()[0].slots is None  # nothing stale


def three_slot_server(tiny_gguf: Path) -> tuple[subprocess.Popen, str]:
    """A llama-server of 3 slots (3,072 tokens of context in all) with its slots and metrics endpoints on, and its
    URL: in a session of its own (the test kills its group)."""
    port = free_port()
    proc = subprocess.Popen([LLAMA_SERVER, "-m", str(tiny_gguf), "--port", str(port), "-np", "3", "-c", "3072",
                             "-t", "1", "--slots", "--metrics"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


async def until_healthy(url: str, timeout_s: float = 60.0) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        for _ in range(int(timeout_s / 0.1)):
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)


async def test_attach_detects_llama_server_and_reads_its_slots(config_dir: Path, tiny_gguf: Path) -> None:
    proc, url = three_slot_server(tiny_gguf)
    try:
        await until_healthy(url)
        app = offline_app(config_dir, attach_url=url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.kind == "llamacpp" and app.view.foreign.endpoints[0].reachable,
                           timeout_s=30, what="llama.cpp detected")
            await generate(url, max_tokens=8, prompt="abc " * 200)
            slots = lambda: app.view.foreign.endpoints[0].slots or []  # noqa: E731
            await wait_for(pilot, lambda: any((s.held_tokens or 0) >= 801 + 7 for s in slots()), timeout_s=30,
                           what="a slot holding the prompt's 801 tokens and 8 generated")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_a_busy_llama_server_shows_a_decode_rate_from_its_token_counter(config_dir: Path,
                                                                              tiny_gguf: Path) -> None:
    """Three slots kept decoding on a real llama-server: its `llamacpp:predicted_tokens_seconds` gauge reads 0
    between finished requests, so the rate on screen comes from its token counter over time, and it is above
    zero while tokens flow."""
    proc, url = three_slot_server(tiny_gguf)
    stop = asyncio.Event()

    async def keep_decoding() -> None:
        while not stop.is_set():
            await generate(url, max_tokens=900)

    try:
        await until_healthy(url)
        app = offline_app(config_dir, attach_url=url)
        async with app.run_test(size=SIZE) as pilot:
            end = lambda: app.view.foreign.endpoints[0]  # noqa: E731
            await wait_for(pilot, lambda: app.view.kind == "llamacpp" and end().reachable, timeout_s=30,
                           what="llama.cpp detected")
            senders = [asyncio.create_task(keep_decoding()) for _ in range(3)]
            await wait_for(pilot, lambda: (end().decode_tokens_s or 0) > 0, timeout_s=30,
                           what="a decode rate above zero while three slots decode")
            app.screen.redraw(force=True)
            await pilot.pause()
            shown = re.search(r"decode ([\d,.]+k?) tok/s", screen_text(app))
            assert shown and shown.group(1) not in ("0", "0.0"), screen_text(app)
            stop.set()
            await asyncio.gather(*senders)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_bench_scenario_runs_against_llama_server(tmp_path: Path, tiny_gguf: Path) -> None:
    """`strata-engine bench scenario` speaks plain OpenAI: the same load on llama.cpp as on Strata."""
    import json
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([LLAMA_SERVER, "-m", str(tiny_gguf), "--port", str(port), "-np", "2", "-c", "4096",
                             "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not answer /health"
            time.sleep(0.1)
        out = tmp_path / "reuse.json"
        done = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "scenario", "reuse", "--url",
                               f"http://127.0.0.1:{port}", "--set", "long_tokens=600", "--set", "max_tokens=8",
                               "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(out.read_text())["scenario"]
        assert result["ok"] is True
        assert result["metrics"]["second_cached_tokens"] > 500  # llama.cpp's prompt cache, as it reports it
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
