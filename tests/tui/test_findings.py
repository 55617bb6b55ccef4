"""What a new user met in strata-tui and no longer meets: a load against a server that is not an engine dumps no
HTML page, attaching to a dead port says "connection refused", the MoE-only switch key on a dense engine changes
nothing and says so, a stop's WARNING line is not called an error, a metric a scenario could not measure says
why, and `l` on another engine kind fits its context and gives that engine's own advice."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tui.conftest import fake_engine_app, offline_app, screen_text, wait_for
from tests.tui.engine_replay import replay_server, routes_for

SIZE = (160, 48)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def web_server(tmp_path: Path):
    """A plain web server (Python's http.server): it answers every API route with an HTML error page."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = __import__("time").monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if __import__("time").monotonic() > deadline:
                    raise
                __import__("time").sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_load_against_a_web_server_shows_no_html(config_dir: Path, web_server: str) -> None:
    app = offline_app(config_dir, attach_url=web_server, attach_kind="vllm")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.monitor.engine_state == "ready", 20, "the endpoint read")
        await pilot.press("l")
        await wait_for(pilot, lambda: app.view.load_result is not None, 30, "the load's result")
        await wait_for(pilot, lambda: "Load result" in screen_text(app), 10, "the result panel")
        shown = screen_text(app)
        assert "<!DOCTYPE" not in app.view.load_result and "<html" not in app.view.load_result
        assert "<" not in shown.split("Load result")[1][:2000]
        assert "an HTML page (Error response" in app.view.load_result, app.view.load_result
        assert "404" in app.view.load_result
        await pilot.press("q")


async def test_attaching_to_a_dead_port_says_connection_refused(config_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    app = offline_app(config_dir, attach_url=url)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.view.monitor.engine_state == "not detected", 20, "detection to give up")
        text = screen_text(app)
        assert "connection refused" in text, text
        assert any("connection refused" in n.message and url in n.message for n in app._notifications)
        await pilot.press("q")


async def test_the_moe_only_key_on_a_dense_engine_says_so_and_changes_nothing(config_dir: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected and any(
            v.running is not None for v in app.view.monitor.switches.values()), 20, "the engine's state")
        before = app.store.path("default").read_text()
        await pilot.press("9")
        await wait_for(pilot, lambda: "EXPERT_LFU: MoE only" in screen_text(app), 10, "the refusal on screen")
        await pilot.pause(0.5)
        assert app.store.path("default").read_text() == before  # nothing written
        assert app.view.monitor.switches["EXPERT_LFU"].wanted is False
        await pilot.press("q")


async def test_after_s_a_warning_line_is_called_a_warning(config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = fake_engine_app(config_dir, monkeypatch, mode="warn-term", events=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, 20, "the engine")
        await pilot.press("s")
        await wait_for(pilot, lambda: "Engine stopped" in screen_text(app), 20, "the stop panel")
        await wait_for(pilot, lambda: "stopping with 2 requests running" in screen_text(app), 10, "its warning")
        text = screen_text(app)
        assert "last warning: " in text and "last error: " not in text, text
        await pilot.press("q")


async def test_a_metric_the_scenario_could_not_measure_says_why(config_dir: Path) -> None:
    from engine.loadgen.scenarios import ScenarioResult
    from strata_tui.engine_io.messages import LoadProgress
    from strata_tui.engine_io.workers import scenario_report

    result = ScenarioResult("seed", "http://127.0.0.1:1", "m", {}, 0.0)
    result.metrics = {"long_ttft_s": 1.5, "short_decode_tok_s_during_long_prefill": None, "decode_ratio": None}
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(LoadProgress(scenario_report(result), done=True))
        await wait_for(pilot, lambda: "Load result" in screen_text(app), 10, "the result panel")
        text = screen_text(app)
        assert "n/a (no short generation decoded" in text and "n/a (needs both short decode rates" in text, text
        assert "n/a (no short generation decoded while the long prompt was prefilled)" in app.view.load_result
        await pilot.press("q")


async def test_l_on_a_llamacpp_server_gives_llamacpps_own_advice(config_dir: Path) -> None:
    routes = routes_for("llamacpp")
    props = json.loads(routes["/props"][2])
    props["default_generation_settings"]["n_ctx"] = 200  # a slot's context: too small for a long prompt
    routes["/props"] = (200, "application/json", json.dumps(props))
    routes["/v1/models"] = (200, "application/json", json.dumps({"data": [{"id": "tiny"}]}))
    with replay_server(routes) as server:
        app = offline_app(config_dir, attach_url=server.url, attach_kind="llamacpp")
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.monitor.engine_state == "ready", 20, "the endpoint read")
            await pilot.press("l")
            await wait_for(pilot, lambda: app.view.load_result is not None, 30, "the load's result")
            result = app.view.load_result
            assert "-c (ctx_size)" in result and "--context" not in result, result
            assert "context is 200 tokens" in result
            await pilot.press("q")
