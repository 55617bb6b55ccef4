"""The app with vLLM / SGLang / llama.cpp: a profile of each kind launches (or is refused naming its missing
program), its crash panel names the engine's real error, attach detects each kind and fills the one monitor,
and of several endpoints one unreachable is marked while the others keep updating."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from strata_tui.adapters.crash_lines import pick_engine_error
from strata_tui.profiles.store import ProfileStore
from tests.tui.conftest import offline_app, screen_text, wait_for
from tests.tui.engine_replay import ENGINES, LLAMACPP, VLLM, replay_server, routes_for

SIZE = (160, 48)
REPLAY_LOG = [sys.executable, str(Path(__file__).parent / "replay_log.py")]


def write_profile(config_dir: Path, name: str, text: str) -> None:
    (config_dir / "profiles").mkdir(parents=True, exist_ok=True)
    (config_dir / "profiles" / f"{name}.toml").write_text(text)


@pytest.mark.parametrize("kind, model", [("vllm", "Qwen/Qwen3-8B"), ("sglang", "Qwen/Qwen3-8B"),
                                         ("llamacpp", "/models/m.gguf")])
async def test_a_missing_program_is_refused_in_one_line(config_dir: Path, monkeypatch, kind: str, model: str) -> None:
    monkeypatch.setenv("PATH", str(config_dir))  # nothing on it
    write_profile(config_dir, "p", f'[engine]\nkind = "{kind}"\nmodel = "{model}"\n')
    app = offline_app(config_dir, profile="p", launch=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.status_note, what="the refusal")
        program = {"vllm": "vllm", "sglang": "python", "llamacpp": "llama-server"}[kind]
        assert app.view.status_note.endswith(f"'{program}' not found on PATH (set [engine] program to its path)")
        assert "\n" not in app.view.status_note and app.process is None
        assert "not found on PATH" in screen_text(app)


@pytest.mark.parametrize("kind, log, expected", [
    ("vllm", f"{VLLM}-oom.log", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("llamacpp", f"{LLAMACPP}-alloc.log", "failed to allocate buffer of size 1099511562240"),
])
async def test_the_crash_panel_shows_the_engines_real_error(config_dir: Path, kind: str, log: str,
                                                           expected: str) -> None:
    program = ", ".join(f'"{p}"' for p in [*REPLAY_LOG, str(ENGINES / log)])
    write_profile(config_dir, "p", f'[engine]\nkind = "{kind}"\nmodel = "m"\nprogram = [{program}]\nport = 1\n')
    app = offline_app(config_dir, profile="p", launch=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.crash is not None, timeout_s=20, what="the crash panel")
        await pilot.pause(0.3)
        app.screen.redraw(force=True)
        await pilot.pause()
        assert expected in app.view.crash.error
        text = screen_text(app)
        assert "engine exited with exit code 1" in text and expected[:60] in text


def test_crash_lines_prefer_the_root_cause() -> None:
    vllm = (ENGINES / f"{VLLM}-oom.log").read_text().splitlines()
    assert "RuntimeError: Engine core" not in pick_engine_error("vllm", vllm)
    llama = (ENGINES / f"{LLAMACPP}-alloc.log").read_text().splitlines()
    assert pick_engine_error("llamacpp", llama).startswith("ggml_backend_cpu_buffer_type_alloc_buffer: failed")
    assert pick_engine_error("sglang", ["INFO all fine"]) is None


@pytest.mark.parametrize("kind, shown", [
    ("vllm", ["vLLM · 1 endpoint", "spec accepted per position 1:82%  2:63%  3:40%",
              "prefill: vLLM exposes no per-request prefill progress"]),
    ("sglang", ["SGLang · 1 endpoint", "mean length 2.61", "prefill: SGLang exposes no per-request prefill"]),
    ("llamacpp", ["llama.cpp · 1 endpoint", "prefill  processing  16,384", "latency: llama.cpp exports no latency histograms"]),
])
async def test_attach_detects_the_kind_and_fills_the_monitor(config_dir: Path, kind: str, shown: list[str]) -> None:
    with replay_server(routes_for(kind)) as server:
        app = offline_app(config_dir, attach_url=server.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.foreign is not None and app.view.foreign.endpoints[0].reachable,
                           what=f"{kind} detected and read")
            app.screen.redraw(force=True)
            await pilot.pause()
            text = screen_text(app)
            assert app.view.kind == kind
            for piece in shown:
                assert piece in text, piece
            assert "Switches" not in text and "Graph cache" not in text  # Strata-only panels are gone


async def test_kind_flag_skips_detection(config_dir: Path) -> None:
    with replay_server(routes_for("vllm")) as server:
        app = offline_app(config_dir, attach_url=server.url, attach_kind="vllm")
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.foreign and app.view.foreign.endpoints[0].reachable)
            assert "/get_server_info" not in server.hits and "/props" not in server.hits


async def test_one_unreachable_endpoint_is_marked_and_the_others_keep_updating(config_dir: Path) -> None:
    with replay_server(routes_for("vllm")) as a, replay_server(routes_for("vllm")) as b:
        app = offline_app(config_dir, attach_url=f"{a.url},{b.url}", attach_kind="vllm")
        async with app.run_test(size=SIZE) as pilot:
            ends = lambda: app.view.foreign.endpoints  # noqa: E731
            await wait_for(pilot, lambda: app.view.foreign and all(e.reachable for e in ends()), what="both read")
            app.screen.redraw(force=True)
            await pilot.pause()
            assert "all 2: 2 up · running 42 · waiting 6" in screen_text(app)
            b.stop()
            await wait_for(pilot, lambda: not ends()[1].reachable, timeout_s=15, what="b marked unreachable")
            before = ends()[0].read_at
            await wait_for(pilot, lambda: ends()[0].read_at > before, timeout_s=15, what="a read again")
            assert ends()[0].reachable and ends()[1].running is None  # no stale values for b
            app.screen.redraw(force=True)
            await pilot.pause()
            text = screen_text(app)
            assert "unreachable since" in text and "all 2: 1 up · running 21 · waiting 3" in text


def test_profiles_of_each_kind_round_trip_through_the_store(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    write_profile(tmp_path, "ll", '[engine]\nkind = "llamacpp"\nmodel = "/m/F.gguf"\nparallel = 6\n'
                                  'ctx_size = 262144\nextra_args = ["--flash-attn", "on"]\n[env]\nLLAMA_ARG_X = "1"\n')
    profile = store.load("ll")
    assert profile.foreign.argv() == ["llama-server", "-m", "/m/F.gguf", "--host", "127.0.0.1", "--port", "8080",
                                      "-np", "6", "-c", "262144", "--slots", "--metrics", "--flash-attn", "on"]
    assert profile.foreign.child_env({})["LLAMA_ARG_X"] == "1"
    write_profile(tmp_path, "bad", '[engine]\nkind = "vllm"\nmodel = "m"\ntensor_parallel_size = 0\n')
    with pytest.raises(Exception) as info:
        store.load("bad")
    assert "bad.toml:4: engine.tensor_parallel_size: expected 1..1024 (value 0)" in str(info.value)
    write_profile(tmp_path, "typo", '[engine]\nkind = "vlm"\nmodel = "m"\n')
    with pytest.raises(Exception) as info:
        store.load("typo")
    assert "engine.kind: expected one of strata, vllm, sglang, llamacpp (value 'vlm')" in str(info.value)


async def test_the_profiles_screen_lists_a_vllm_profile_with_its_command(config_dir: Path) -> None:
    write_profile(config_dir, "v", '[engine]\nkind = "vllm"\nmodel = "Qwen/Qwen3-8B"\ntensor_parallel_size = 2\n')
    app = offline_app(config_dir, profile="v")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        await wait_for(pilot, lambda: "$ vllm serve Qwen/Qwen3-8B" in screen_text(app), what="the command line")
        text = screen_text(app)
        assert "--tensor-parallel-size 2" in text and "vLLM" in text
        await pilot.press("e")
        await wait_for(pilot, lambda: any("kind vllm: edit its file by hand" in n.message for n in app._notifications),
                       what="the editor's refusal")


def test_vllms_access_lines_for_this_apps_reads_stay_out_of_the_log() -> None:
    from strata_tui.state.view_state import ViewState

    view = ViewState(mode="launched")
    view.append_log([("stdout", '(APIServer pid=1) INFO:     127.0.0.1:50312 - "GET /metrics HTTP/1.1" 200 OK'),
                     ("stdout", '(APIServer pid=1) INFO:     127.0.0.1:50312 - "GET /version HTTP/1.1" 200 OK'),
                     ("stdout", '(APIServer pid=1) INFO:     127.0.0.1:50400 - "POST /v1/completions HTTP/1.1" 200 OK')])
    assert view.own_polling_lines == 2 and [line for _, line in view.log_lines][0].endswith('completions HTTP/1.1" 200 OK')


def test_the_api_key_travels_in_the_environment_never_in_argv(tmp_path: Path) -> None:
    write_profile(tmp_path, "v", '[engine]\nkind = "vllm"\nmodel = "m"\napi_key = "sk-secret"\n')
    write_profile(tmp_path, "s", '[engine]\nkind = "sglang"\nmodel = "m"\napi_key = "sk-secret"\n')
    store = ProfileStore(tmp_path)
    engine = store.load("v").foreign
    assert "sk-secret" not in " ".join(engine.argv()) and engine.child_env({})["VLLM_API_KEY"] == "sk-secret"
    with pytest.raises(Exception) as info:
        store.load("s")
    assert "engine.api_key: SGLang reads its key only from its command line" in str(info.value)
    assert "sk-secret" not in str(info.value)


def test_kind_needs_attach_and_every_attached_url_is_checked() -> None:
    import subprocess

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "strata_tui.cli", *args], capture_output=True, text=True,
                              timeout=60)

    done = run("--kind", "vllm")
    assert done.returncode == 2 and done.stderr.strip() == ("strata-tui: error: --kind vllm: only with --attach "
                                                            "(a profile says its kind in [engine] kind)")
    done = run("--attach", "http://a:8000,b:8000")
    assert done.returncode == 2 and "expected an http:// or https:// URL" in done.stderr


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_launch_ready_on_health_then_stop_and_restart(config_dir: Path, kind: str) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    program = ", ".join(f'"{p}"' for p in [sys.executable, str(Path(__file__).parent / "replay_engine.py"), kind])
    write_profile(config_dir, "p", f'[engine]\nkind = "{kind}"\nmodel = "Qwen/Qwen3-8B"\nprogram = [{program}]\n'
                                   f'port = {port}\n')
    app = offline_app(config_dir, profile="p", launch=True, stop_timeout_s=3.0)
    async with app.run_test(size=SIZE) as pilot:
        ends = lambda: app.view.foreign.endpoints if app.view.foreign else []  # noqa: E731
        await wait_for(pilot, lambda: app.view.monitor.engine_state == "ready" and ends() and ends()[0].reachable,
                       timeout_s=30, what="ready on /health, then read")
        assert f"--port {port}" in " ".join(app.process.argv) and ends()[0].running in (21, 17)
        await pilot.press("s")
        await wait_for(pilot, lambda: app.view.crash is not None, timeout_s=15, what="the stop")
        assert app.view.crash.why_stopped == "you pressed s" and not app.process.running
        app.screen.redraw(force=True)
        await pilot.pause()
        assert "engine stopped (you pressed s)" in screen_text(app)
        first = app.process.pid
        await pilot.press("r")
        await wait_for(pilot, lambda: app.process.pid != first and app.view.crash is None
                       and app.view.monitor.engine_state == "ready" and ends() and ends()[0].reachable,
                       timeout_s=30, what="the restart")
