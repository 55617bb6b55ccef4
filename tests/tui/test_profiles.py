"""Profiles: first-run default, TOML round trip, atomic writes, broken files reported and never overwritten."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from engine.config import BUILTIN_MODEL
from engine.errors import ConfigError
from strata_tui.profiles.profile import DEFAULT_PROFILE, Profile, ProfileError, default_config_dir
from strata_tui.profiles.store import ProfileStore


def test_config_dir_env_override(config_dir: Path) -> None:
    assert default_config_dir() == config_dir
    assert ProfileStore().profiles_dir == config_dir / "profiles"


def test_first_run_writes_default_profile(config_dir: Path) -> None:
    store = ProfileStore()
    opened = store.open_initial()
    assert isinstance(opened, Profile) and opened.name == DEFAULT_PROFILE
    doc = tomllib.loads((config_dir / "profiles" / "default.toml").read_text())
    assert doc["engine"]["model"] == BUILTIN_MODEL and doc["engine"]["device"] == "auto"
    assert set(doc) == {"engine", "switches", "tui"}
    assert store.last_used() == DEFAULT_PROFILE


def test_opens_last_used_profile(config_dir: Path) -> None:
    store = ProfileStore()
    store.open_initial()
    store.create("big", Profile("big").with_engine(batch=8))
    assert store.open_initial("big").engine.batch == 8
    again = ProfileStore().open_initial()
    assert again.name == "big" and again.engine.batch == 8


def test_round_trip_keeps_every_option_and_switch(config_dir: Path) -> None:
    store = ProfileStore()
    profile = Profile("p").with_engine(batch=6, batch_mtp=True, mtp_depth=2, kv="int8", kv_resident=4096,
                                       context=16384, vram_reserve_mib=1280, peer_device="cuda:1", port=8123,
                                       api_key="k").with_switch("SPLIT_ATTN", True)
    store.save(profile)
    loaded = store.load("p")
    assert loaded.engine == profile.engine
    text = store.path("p").read_text()
    assert "STRATA_SPLIT_ATTN = true" in text


def test_atomic_write_leaves_no_temp_files(config_dir: Path) -> None:
    store = ProfileStore()
    for reserve in (100, 200, 300):
        store.save(Profile("a").with_engine(vram_reserve_mib=reserve))
    assert sorted(p.name for p in store.profiles_dir.iterdir()) == ["a.toml"]
    assert store.load("a").engine.vram_reserve_mib == 300


def test_toml_syntax_error_names_path_and_line(config_dir: Path) -> None:
    store = ProfileStore()
    path = store.profiles_dir / "bad.toml"
    path.parent.mkdir(parents=True)
    path.write_text('[engine]\nmodel = "x"\nbatch = = 4\n')
    with pytest.raises(ProfileError) as info:
        store.load("bad")
    assert info.value.path == path and info.value.line == 3
    assert str(path) in str(info.value) and ":3" in str(info.value)


def test_bad_value_names_key_line_and_reason(config_dir: Path) -> None:
    store = ProfileStore()
    path = store.profiles_dir / "bad.toml"
    path.parent.mkdir(parents=True)
    path.write_text('[engine]\nmodel = "builtin:strata-tiny"\n\nkv = "fp4"\n')
    with pytest.raises(ProfileError) as info:
        store.load("bad")
    assert info.value.key == "engine.kv" and info.value.line == 4
    assert "fp4" in info.value.message and "bf16" in info.value.message


def test_unknown_switch_and_non_bool_switch_are_named(config_dir: Path) -> None:
    store = ProfileStore()
    store.profiles_dir.mkdir(parents=True)
    (store.profiles_dir / "typo.toml").write_text('[switches]\nSTRATA_SPLIT_ATN = true\n')
    (store.profiles_dir / "nonbool.toml").write_text('[switches]\nSTRATA_SPLIT_ATTN = "yes"\n')
    with pytest.raises(ProfileError) as typo:
        store.load("typo")
    assert typo.value.key == "switches.STRATA_SPLIT_ATN" and typo.value.line == 2
    with pytest.raises(ProfileError) as nonbool:
        store.load("nonbool")
    assert "true or false" in nonbool.value.message


def test_bad_tui_value_is_named(config_dir: Path) -> None:
    store = ProfileStore()
    store.profiles_dir.mkdir(parents=True)
    (store.profiles_dir / "t.toml").write_text('[tui]\nrefresh_s = 0\n')
    with pytest.raises(ProfileError) as info:
        store.load("t")
    assert info.value.key == "tui.refresh_s" and info.value.line == 2


def test_broken_profile_is_never_overwritten(config_dir: Path) -> None:
    store = ProfileStore()
    store.profiles_dir.mkdir(parents=True)
    broken = 'this is [not toml\n'
    (store.profiles_dir / "default.toml").write_text(broken)
    opened = store.open_initial()
    assert isinstance(opened, ProfileError)
    with pytest.raises(ProfileError, match="not overwriting"):
        store.save(Profile("default"))
    assert (store.profiles_dir / "default.toml").read_text() == broken
    listing = store.load_all()
    assert len(listing) == 1 and isinstance(listing[0], ProfileError)


def test_create_duplicate_rename_delete(config_dir: Path) -> None:
    store = ProfileStore()
    store.create("one", Profile("x").with_engine(batch=3))
    store.duplicate("one", "two")
    assert store.load("two").engine.batch == 3
    with pytest.raises(ConfigError, match="exists"):
        store.create("two")
    store.set_last_used("two")
    store.rename("two", "three")
    assert store.names() == ["one", "three"] and store.last_used() == "three"
    store.delete("three")
    assert store.names() == ["one"] and store.last_used() is None


@pytest.mark.parametrize("name", ["", "../evil", "a b", ".hidden", "x" * 65])
def test_bad_names_are_refused(config_dir: Path, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        ProfileStore().create(name)
    assert info.value.param == "name"


def test_missing_requested_profile_is_an_error_not_a_new_file(config_dir: Path) -> None:
    store = ProfileStore()
    opened = store.open_initial("nope")
    assert isinstance(opened, ProfileError) and "no such profile" in str(opened)
    assert not store.path("nope").exists()
