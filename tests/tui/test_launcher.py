"""The launcher: argv and env from a config, line splitting, ready detection, stop via the process group."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import EngineConfig
from strata_tui.engine_io.launcher import EngineProcess, LineSplitter, engine_argv, engine_env


def test_argv_is_a_list_from_to_argv_and_env_carries_switches() -> None:
    config = EngineConfig(batch=6, batch_mtp=True, kv="int8", switches={"SPLIT_ATTN": True, "COMPILE": False})
    argv = engine_argv(config)
    assert argv[:4] == [sys.executable, "-m", "engine.cli", "serve"]
    assert argv[4:] == config.to_argv() and "--batch-mtp" in argv
    env = engine_env(config, base={"PATH": "/bin", "STRATA_FUSED_PROJ": "1", "STRATA_API_KEY": "k",
                                   "STRATA_FAULT_INJECT": "capture:*:1:oom"})
    assert env["STRATA_SPLIT_ATTN"] == "1" and env["STRATA_COMPILE"] == "0"
    assert "STRATA_FUSED_PROJ" not in env, "an inherited switch must not leak past the profile"
    assert env["STRATA_API_KEY"] == "k" and env["PATH"] == "/bin"
    assert env["STRATA_FAULT_INJECT"] == "capture:*:1:oom", "non-switch settings pass through"
    assert str(Path(__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)


def test_the_profile_api_key_goes_to_the_environment_never_to_argv() -> None:
    config = EngineConfig(api_key="profile-secret", host="0.0.0.0")
    assert not any("profile-secret" in arg for arg in engine_argv(config))  # argv is in every process list
    assert engine_env(config, base={"PATH": "/bin"})["STRATA_API_KEY"] == "profile-secret"


def test_splitter_handles_cr_crlf_across_chunks_and_utf8_splits() -> None:
    splitter = LineSplitter()
    data = "a\r\nb\rc\nprogress 10%\rprogress 20%\rdone\r\n€uro\n".encode()
    lines: list[str] = []
    for i in range(len(data)):
        lines += splitter.feed(data[i:i + 1])
    lines += splitter.flush()
    assert lines == ["a", "b", "c", "progress 10%", "progress 20%", "done", "€uro"]


def test_splitter_has_no_line_length_limit_but_bounds_pieces() -> None:
    splitter = LineSplitter()
    big = b"x" * 200_000 + b"\n"
    lines = splitter.feed(big[:100_000]) + splitter.feed(big[100_000:]) + splitter.flush()
    assert "".join(lines) == "x" * 200_000
    assert max(len(line) for line in lines) <= 16 * 1024


def test_splitter_replaces_bad_bytes_and_flushes_tail() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"ok\xff\xfe\nlast") == ["ok\ufffd\ufffd"]
    assert splitter.flush() == ["last"]


CHILD = textwrap.dedent("""
    import os, subprocess, sys, time, signal
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stdin closed:", sys.stdin is None or sys.stdin.read() == "", flush=True)
    print("switch:", os.environ.get("STRATA_SPLIT_ATTN"), flush=True)
    sys.stderr.write("warming 1\\rwarming 2\\r\\n"); sys.stderr.flush()
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("grandchild", grandchild.pid, flush=True)
    print("strata-engine: ready at http://127.0.0.1:5555", flush=True)
    time.sleep(60)
""")


async def _run_child(tmp_path: Path, ignore_term: bool) -> tuple[list[tuple[str, str]], list[str], EngineProcess]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = engine_env(EngineConfig(switches={"SPLIT_ATTN": True}))
    if ignore_term:
        env["IGNORE_TERM"] = "1"
    lines: list[tuple[str, str]] = []
    ready: list[str] = []
    proc = EngineProcess([sys.executable, str(script)], env,
                         on_output=lambda s, ls: lines.extend((s, x) for x in ls), on_ready=ready.append)
    task = asyncio.create_task(proc.run())
    for _ in range(200):
        if ready:
            break
        await asyncio.sleep(0.05)
    assert ready == ["http://127.0.0.1:5555"]
    started = asyncio.get_running_loop().time()
    code = await proc.stop(timeout_s=1.0)
    info = await task
    assert info.requested and info.returncode == code
    assert asyncio.get_running_loop().time() - started < 5
    return lines, ready, proc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False


async def test_engine_process_reads_output_detects_ready_and_stops_group(tmp_path: Path) -> None:
    lines, _, _ = await _run_child(tmp_path, ignore_term=False)
    assert ("stdout", "stdin closed: True") in lines
    assert ("stdout", "switch: 1") in lines
    assert ("stderr", "warming 1") in lines and ("stderr", "warming 2") in lines
    grandchild = int(next(x for s, x in lines if x.startswith("grandchild")).split()[1])
    for _ in range(40):
        if not _alive(grandchild):
            break
        await asyncio.sleep(0.05)
    assert not _alive(grandchild), "stop must reach the whole process group"


async def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    _, _, proc = await _run_child(tmp_path, ignore_term=True)
    assert proc._proc.returncode == -signal.SIGKILL


async def test_missing_program_raises_oserror() -> None:
    proc = EngineProcess(["/nonexistent/strata-engine"], {}, on_output=lambda s, l: None, on_ready=lambda u: None)
    with pytest.raises(OSError):
        await proc.run()
