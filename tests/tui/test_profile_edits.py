"""Profiles never lose a hand edit: saves keep comments, order and format; every write and every launch
re-reads the file; attach mode writes nothing; creation is exclusive; names are whole-string checked;
anything unparsable is listed as broken; the API key never reaches argv."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError
from strata_tui.engine_io.launcher import engine_argv, engine_env
from strata_tui.profiles.profile import Profile, ProfileError
from strata_tui.profiles.store import ProfileStore
from strata_tui.screens.profiles import ProfilesScreen
from tests.tui.conftest import FAKE_ENGINE, create_app, offline_app, screen_text, wait_for

ROOT = Path(__file__).resolve().parents[2]
SIZE = (160, 50)
HAND_WRITTEN = """\
# my box: one H200, long prompts
[engine]
model = "builtin:strata-tiny"   # the embedded one, for now
device = "cpu"
batch = 3                        # three people at once
kv-resident = 512

# measured 2026-11-30: 1024 is too little with graphs
vram_reserve_mib = 1024

[switches]
STRATA_SPLIT_ATTN = false  # try it later

[tui]
refresh_s    = 0.25
"""


def _write(store: ProfileStore, name: str, text: str) -> Path:
    store.profiles_dir.mkdir(parents=True, exist_ok=True)
    path = store.profiles_dir / f"{name}.toml"
    path.write_text(text)
    return path


def _changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    a, b = before.splitlines(), after.splitlines()
    assert len(a) == len(b), f"lines added or removed:\n{after}"
    return [(x, y) for x, y in zip(a, b) if x != y]


def test_every_kind_of_save_keeps_comments_order_and_format(config_dir: Path) -> None:
    store = ProfileStore()
    path = _write(store, "box", HAND_WRITTEN)
    store.set_engine("box", vram_reserve_mib=1088)
    assert _changed_lines(HAND_WRITTEN, path.read_text()) == [("vram_reserve_mib = 1024", "vram_reserve_mib = 1088")]
    store.set_switch("box", "SPLIT_ATTN", True)
    assert _changed_lines(HAND_WRITTEN, path.read_text())[1] == (
        "STRATA_SPLIT_ATTN = false  # try it later", "STRATA_SPLIT_ATTN = true  # try it later")
    before = store.load("box")
    store.apply_edits(before, before.with_engine(batch=4))  # what the editor's ctrl+s does
    text = path.read_text()
    assert "batch = 4                        # three people at once" in text
    assert "kv-resident = 512" in text and "refresh_s    = 0.25" in text and text.startswith("# my box")


def test_a_write_applies_only_its_key_on_top_of_an_external_edit(config_dir: Path) -> None:
    store = ProfileStore()
    path = _write(store, "box", HAND_WRITTEN)
    stale = store.load("box")  # what the app holds
    path.write_text(HAND_WRITTEN.replace("batch = 3 ", "batch = 2 "))  # the person edits the file
    store.set_engine("box", vram_reserve_mib=1088)
    assert store.load("box").engine.batch == 2
    store.apply_edits(stale, stale.with_engine(context=4096))  # editor opened before the hand edit
    assert store.load("box").engine.batch == 2 and store.load("box").engine.context == 4096


def test_a_change_that_would_not_validate_with_the_disk_version_is_refused(config_dir: Path) -> None:
    store = ProfileStore()
    path = _write(store, "box", HAND_WRITTEN)
    with pytest.raises(ProfileError, match="not saved"):
        store.set_engine("box", kv_resident=1 << 20)  # larger than context
    assert path.read_text() == HAND_WRITTEN


def _create_many(config_dir: str, names: list[str], out) -> None:
    store = ProfileStore(Path(config_dir))
    won = []
    for name in names:
        try:
            store.create(name, Profile(name).with_engine(batch=1 + os.getpid() % 7))
            won.append(name)
        except ConfigError:
            pass
    out.put(won)


def test_create_is_exclusive_across_processes(tmp_path: Path) -> None:
    names = [f"p{i}" for i in range(100)]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_create_many, args=(str(tmp_path), names, out)) for _ in range(3)]
    for proc in procs:
        proc.start()
    winners = [name for _ in procs for name in out.get(timeout=60)]
    for proc in procs:
        proc.join(timeout=60)
    assert sorted(winners) == sorted(names), "every name is created exactly once"


def test_stale_temp_files_are_removed_at_start(config_dir: Path) -> None:
    store = ProfileStore()
    _write(store, "default", HAND_WRITTEN)
    stale = store.profiles_dir / ".default.toml.abc123.tmp"
    stale.write_text("half a file")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = store.profiles_dir / ".default.toml.def456.tmp"  # a save running right now in another process
    fresh.write_text("being written")
    store.open_initial()
    assert not stale.exists() and fresh.exists()


@pytest.mark.parametrize("name", ["name\n", "ok\nevil", "a/b", "..", "x\t"])
def test_names_are_checked_as_a_whole(config_dir: Path, name: str) -> None:
    store = ProfileStore()
    with pytest.raises(ConfigError):
        store.create(name)
    assert not store.profiles_dir.exists() or not list(store.profiles_dir.iterdir())


def test_deep_nesting_is_listed_as_broken_with_path_and_reason(config_dir: Path) -> None:
    store = ProfileStore()
    path = _write(store, "deep", "[engine]\nmodel = " + "[" * 500 + "]" * 500 + "\n")
    _write(store, "ok", HAND_WRITTEN)
    listing = store.load_all()
    assert [type(e).__name__ for e in listing] == ["ProfileError", "Profile"]
    assert listing[0].path == path and "RecursionError" in listing[0].message


async def test_the_app_lists_a_deep_nested_profile_as_broken(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    _write(store, "deep", "a = " + "[" * 500 + "]" * 500 + "\n")
    app = offline_app(config_dir, profile="deep")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="profiles screen")
        screen = app.screen
        await wait_for(pilot, lambda: screen.reads_done >= 1, what="the profiles read")
        await pilot.pause()
        text = screen_text(app)
        assert "broken" in text and "RecursionError" in text


@pytest.mark.parametrize("args,param", [(["--profile", "../x"], "--profile"),
                                        (["--profile", "a\nb"], "--profile"),
                                        (["--config-dir", "FILE"], "--config-dir")])
def test_bad_profile_or_config_dir_is_one_line_exit_2(tmp_path: Path, args: list[str], param: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = [str(afile) if a == "FILE" else a for a in args]
    env = {**os.environ, "STRATA_TUI_CONFIG_DIR": str(tmp_path / "cfg"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "strata_tui.cli", *argv, "--no-launch"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and param in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_the_api_key_goes_in_the_environment_never_on_argv() -> None:
    config = EngineConfig(api_key="sk-secret-123")
    assert not any("sk-secret-123" in a for a in engine_argv(config)) and "--api-key" not in engine_argv(config)
    assert engine_env(config, base={})["STRATA_API_KEY"] == "sk-secret-123"
    # a key set where the app was started still reaches the engine (and the app's client uses it too)
    assert engine_env(EngineConfig(), base={"STRATA_API_KEY": "inherited"})["STRATA_API_KEY"] == "inherited"


def test_the_engine_reads_its_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from engine.config import add_engine_options, config_from_args

    monkeypatch.setenv("STRATA_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_engine_options(parser, serving=True)
    assert config_from_args(parser.parse_args([])).api_key == "from-env"


async def test_plus_keeps_the_hand_written_file_and_an_external_edit(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    path = _write(store, "default", HAND_WRITTEN)
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        path.write_text(HAND_WRITTEN.replace("batch = 3 ", "batch = 2 "))
        await pilot.press("plus")
        await wait_for(pilot, lambda: "1088" in path.read_text(), what="the reserve saved")
        await pilot.press("1")
        await wait_for(pilot, lambda: "STRATA_SPLIT_ATTN = true" in path.read_text(), what="the switch saved")
        text = path.read_text()
        assert "batch = 2 " in text and "# measured 2026-11-30" in text and "# try it later" in text


async def test_restart_launches_what_is_on_disk_now(config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "serve")
    monkeypatch.delenv("FAKE_ENGINE_EVENTS", raising=False)
    store = ProfileStore(config_dir)
    path = _write(store, "default", HAND_WRITTEN)
    app = create_app(config_dir=config_dir, engine_program=FAKE_ENGINE, sampler_factory=None, stop_timeout_s=2.0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
        path.write_text(HAND_WRITTEN.replace("batch = 3 ", "batch = 5 "))
        await pilot.press("r")
        await wait_for(pilot, lambda: app.run_id == 2 and app.view.telemetry_connected, what="restart")
        argvs = [line for _, line in app.view.log_lines if line.startswith("$ ")]
        assert "--batch 3" in argvs[0] and "--batch 5" in argvs[-1], argvs
        await pilot.press("q")


async def test_attach_mode_on_a_first_run_creates_no_files(tmp_path: Path) -> None:
    app = offline_app(tmp_path / "fresh", attach_url="http://127.0.0.1:9")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("plus", "1")
        await pilot.pause(0.3)
    assert not (tmp_path / "fresh").exists()


async def test_attach_mode_writes_nothing_locally_and_says_attached(config_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "serve")
    monkeypatch.delenv("FAKE_ENGINE_EVENTS", raising=False)
    engine = subprocess.Popen([*FAKE_ENGINE, "serve"], stdout=subprocess.PIPE, text=True)
    try:
        url = engine.stdout.readline().split()  # the fake's first line
        while "ready at" not in " ".join(url):
            url = engine.stdout.readline().split()
        store = ProfileStore(config_dir)
        path = _write(store, "default", HAND_WRITTEN)
        store.set_last_used("default")
        before = path.read_text()
        app = offline_app(config_dir, attach_url=url[-1])
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.view.telemetry_connected, what="telemetry")
            await pilot.press("plus", "1")
            await wait_for(pilot, lambda: app.view.monitor.switches["SPLIT_ATTN"].note == "applied live",
                           what="switch applied live")
            await wait_for(pilot, lambda: app.view.reserve_note == "applied live", what="reserve applied live")
            status = str(app.screen.query_one("#status").render())
            assert "attached" in status and "default" not in status, status
        assert path.read_text() == before
        assert sorted(p.name for p in store.profiles_dir.iterdir()) == ["default.toml"]
    finally:
        engine.kill()
        engine.wait()


async def test_a_step_on_a_key_edited_by_hand_applies_to_what_the_file_says(config_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "serve")
    monkeypatch.delenv("FAKE_ENGINE_EVENTS", raising=False)
    store = ProfileStore(config_dir)
    path = _write(store, "default", HAND_WRITTEN.replace("vram_reserve_mib = 1024", "vram-reserve-mib = 1600"))
    app = create_app(config_dir=config_dir, engine_program=FAKE_ENGINE, sampler_factory=None, stop_timeout_s=2.0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.telemetry_connected and app.view.monitor.vram_reserve_mib == 1600,
                       what="the engine's reserve")
        path.write_text(path.read_text().replace("vram-reserve-mib = 1600", "vram-reserve-mib = 2000"))
        await pilot.press("plus")
        await wait_for(pilot, lambda: "applied live" in app.view.reserve_note, what="the reserve applied")
        assert "vram-reserve-mib = 2064" in path.read_text()
        assert any("POST /strata/vram-reserve mib=2064" in line for _, line in app.view.log_lines)
        assert app.view.monitor.vram_reserve_mib == 2064
        said = [app.view.reserve_note] + [n.message for n in app._notifications]
        assert any("2000" in text and "2064" in text for text in said), said
        # the next step is on top of the new value, with nothing more to say about the file
        await pilot.press("plus")
        await wait_for(pilot, lambda: "vram-reserve-mib = 2128" in path.read_text(), what="the second step")
        await wait_for(pilot, lambda: app.view.reserve_note == "applied live", what="applied, no conflict")
        await pilot.press("q")


async def test_the_list_reads_off_the_ui_thread_and_marks_a_huge_file_broken(config_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store = ProfileStore(config_dir)
    _write(store, "default", HAND_WRITTEN)
    big = _write(store, "big", "[engine]\n" + ".".join(["a"] * 50_000) + " = 1\n")  # 100 KB, 50,000 dotted keys
    os.mkfifo(store.profiles_dir / "pipe.toml")
    _write(store, "slow", HAND_WRITTEN)
    read_text = ProfileStore.read_text

    def slow_disk(self, name: str) -> str:  # fault injection: one file on a disk that takes seconds
        if name == "slow":
            time.sleep(6)
        return read_text(self, name)

    monkeypatch.setattr(ProfileStore, "read_text", slow_disk)
    app = offline_app(config_dir)
    async with app.run_test(size=SIZE) as pilot:
        started = time.monotonic()
        await pilot.press("p")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfilesScreen), what="profiles screen")
        await pilot.press("escape")  # the keys work while the directory is read
        await wait_for(pilot, lambda: not isinstance(app.screen, ProfilesScreen), what="back")
        assert time.monotonic() - started < 4, "the screen waited for the slow read"
        await pilot.press("p")
        screen = app.screen
        await wait_for(pilot, lambda: screen.reads_done >= 1, timeout_s=30, what="the listing")
        table = screen.query_one("#profiles")
        assert sorted(table.rows) == ["big", "default", "slow"]  # no FIFO
        table.move_cursor(row=table.get_row_index("big"))
        await pilot.pause()
        detail = str(screen.query_one("#detail").render())
        assert str(big) in detail.replace("\n", "") and "too large" in detail, detail
