"""The profile store against what real directories hold: two app instances saving one profile at once (every
save lands), a FIFO or a huge file named `*.toml` (never blocks, never freezes), a symlinked profile and one
with its own mode (written through the link, mode kept)."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from strata_tui.profiles import store as profile_store
from strata_tui.profiles.profile import Profile, ProfileError
from strata_tui.profiles.store import ProfileStore

HAND_WRITTEN = """\
# mine
[engine]
model = "builtin:strata-tiny"   # the embedded one
vram_reserve_mib = 1024

[tui]
reserve_step_mib = 1
reserve_big_step_mib = 1
"""


def _write(store: ProfileStore, name: str, text: str) -> Path:
    store.profiles_dir.mkdir(parents=True, exist_ok=True)
    path = store.profiles_dir / f"{name}.toml"
    path.write_text(text)
    return path


def _save_many(config_dir: str, key: str, saves: int, start, out) -> None:
    """Set `[tui] key` to 1..saves, one save each; after each, read the file back: a later value of our own
    key is impossible (only we write it), so anything else than the value just saved is a lost save."""
    store = ProfileStore(Path(config_dir))
    start.wait(timeout=30)
    lost = []
    for value in range(1, saves + 1):
        store.update("box", {"tui": {key: value}})
        seen = getattr(store.load("box").tui, key)
        if seen != value:
            lost.append((value, seen))
    out.put((key, lost))


def test_two_processes_saving_one_profile_lose_nothing(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    path = _write(store, "box", HAND_WRITTEN)
    saves = 150
    ctx = multiprocessing.get_context("fork")
    out, start = ctx.Queue(), ctx.Event()
    keys = ("reserve_step_mib", "reserve_big_step_mib")
    procs = [ctx.Process(target=_save_many, args=(str(config_dir), key, saves, start, out)) for key in keys]
    for proc in procs:
        proc.start()
    start.set()
    results = dict(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert results == {key: [] for key in keys}, "saves overwritten by the other process"
    final = store.load("box").tui
    assert (final.reserve_step_mib, final.reserve_big_step_mib) == (saves, saves)
    text = path.read_text()
    assert text.startswith("# mine\n") and "# the embedded one" in text
    assert sorted(p.name for p in store.profiles_dir.iterdir()) == ["box.toml"], "no lock or temp file left"


def _in_thread(function, timeout_s: float):
    """Run `function` in a daemon thread; (True, result) if it returned in time, else (False, None)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(function()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    return (bool(box), box[0] if box else None)


def test_a_fifo_named_toml_never_blocks(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    _write(store, "ok", HAND_WRITTEN)
    fifo = store.profiles_dir / "pipe.toml"
    os.mkfifo(fifo)
    try:
        done, listing = _in_thread(store.load_all, timeout_s=10)
        assert done, "listing the profiles blocked on a FIFO"
        assert [p.name for p in listing if isinstance(p, Profile)] == ["ok"]
        done, result = _in_thread(lambda: _error_of(lambda: store.load("pipe")), timeout_s=10)
        assert done, "loading a FIFO by name blocked"
        assert result.path == fifo and "not a regular file" in result.message
    finally:
        try:  # anything still blocked in open() on the FIFO gets its writer, then end of file
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader left


def _error_of(function) -> ProfileError:
    try:
        function()
    except ProfileError as exc:
        return exc
    raise AssertionError("no ProfileError")


def test_a_huge_profile_is_listed_broken_with_path_and_reason_at_once(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    _write(store, "ok", HAND_WRITTEN)
    big = _write(store, "big", "[engine]\n" + ".".join(["a"] * 50_000) + " = 1\n")  # ~100 KB, 50,000 dotted keys
    started = time.monotonic()
    listing = store.load_all()
    took_s = time.monotonic() - started
    broken = [e for e in listing if isinstance(e, ProfileError)]
    assert len(broken) == 1 and broken[0].path == big
    limit = str(profile_store.MAX_PROFILE_BYTES)
    assert "too large" in broken[0].message and limit in broken[0].message.replace(",", "")
    assert took_s < 5, f"listing took {took_s:.1f} s"
    with pytest.raises(ProfileError, match="too large"):
        store.update("big", {"engine": {"batch": 2}})


def test_a_deeply_dotted_key_under_the_size_limit_is_broken_not_slow(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    path = _write(store, "deep", "[engine]\nbatch = 2\n" + ".".join(["a"] * 20_000) + " = 1\n")  # 40 KB
    assert path.stat().st_size < profile_store.MAX_PROFILE_BYTES
    started = time.monotonic()
    error = _error_of(lambda: store.load("deep"))
    took_s = time.monotonic() - started
    assert error.path == path and error.line == 3 and "nested" in error.message
    assert took_s < 2, f"reading took {took_s:.1f} s"


def test_saving_a_symlinked_profile_writes_through_the_link_and_keeps_the_mode(config_dir: Path,
                                                                               tmp_path: Path) -> None:
    store = ProfileStore(config_dir)
    store.profiles_dir.mkdir(parents=True)
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    target = dotfiles / "box.toml"
    target.write_text(HAND_WRITTEN)
    target.chmod(0o644)
    link = store.profiles_dir / "box.toml"
    link.symlink_to(target)
    store.set_engine("box", vram_reserve_mib=2048)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert store.load("box").engine.vram_reserve_mib == 2048
    assert "vram_reserve_mib = 2048" in target.read_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in dotfiles.iterdir()) == ["box.toml"], "no temp file left beside the target"


def test_saving_keeps_a_profiles_own_mode(config_dir: Path) -> None:
    store = ProfileStore(config_dir)
    path = _write(store, "box", HAND_WRITTEN)
    path.chmod(0o640)
    store.set_engine("box", batch=2)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and store.load("box").engine.batch == 2


def test_saves_of_profiles_read_before_a_concurrent_save_lose_no_update(config_dir: Path) -> None:
    """Read, change, save, in two threads at once: a save of a profile read before the other thread's save
    would write its stale values back (a lost update); it is refused instead, and the caller reads again."""
    store = ProfileStore(config_dir)
    store.save(Profile("box").with_engine(vram_reserve_mib=0))
    rounds, refused = 100, []

    def bump() -> None:
        for _ in range(rounds):
            while True:
                read = store.load("box")
                try:
                    store.save(read.with_engine(vram_reserve_mib=read.engine.vram_reserve_mib + 1))
                    break
                except ProfileError as exc:
                    refused.append(exc)

    threads = [threading.Thread(target=bump) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert store.load("box").engine.vram_reserve_mib == 2 * rounds, f"{len(refused)} saves were refused"
    assert all("changed on disk" in str(exc) for exc in refused), refused[:1]
