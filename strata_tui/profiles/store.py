"""The profiles directory: list, load, edit in place, create, duplicate, rename, delete, last used.

A profile is a file a person may edit by hand at any time, so the store never regenerates it. Every write
re-reads the file, applies only the keys being changed to the document tomlkit parsed (comments, key order
and formatting stay as written), checks that the result still validates, and replaces the file through a
temp file, fsync and os.replace. In-memory values are never written over what is on disk: a change is a
set of keys, not a whole profile. Creation is exclusive (os.link of a complete temp file), so two
processes creating one name cannot both succeed. Temp files a killed save left behind are removed when
the app starts. A save holds an advisory lock on the profile (`files.locked`) from its read to its
rename, so two app instances saving one profile take turns and every save lands. Only regular files of at
most `MAX_PROFILE_BYTES` are read (a FIFO is left out of the list, a huge file is listed as broken, and
neither blocks); a symlinked profile is written through its link, and a save keeps the file's mode.
Blocking I/O: the app calls these methods from a thread (`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

import tomlkit
from tomlkit.items import Table

from engine.errors import ConfigError
from engine.switches import get_switch
from strata_tui.profiles.files import (MAX_PROFILE_BYTES, TEMP_SUFFIX, UnreadableProfile, is_regular_file, locked,
                                       read_profile_text, write_atomic)
from strata_tui.profiles.profile import (DEFAULT_PROFILE, Profile, ProfileError, check_name, default_config_dir,
                                         parse_profile)

__all__ = ["MAX_PROFILE_BYTES", "ProfileChanged", "ProfileStore", "diff_profiles"]

_STATE_FILE = "state.toml"
MAX_STATE_BYTES = 4096  # the state file holds one name
STALE_TEMP_S = 10.0  # older than any save takes: a temp file this old belongs to a save that was killed

# A change set: section -> key -> new value (None removes the key). Keys are TOML keys (switches by variable).
Changes = Mapping[str, Mapping[str, Any]]


class ProfileChanged(ProfileError):
    """A save of a profile read before the file last changed: nothing was written."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "changed on disk since this profile was read (another save or an editor): "
                               "nothing written; read it again and apply the change to that")


class ProfileStore:
    """Profiles under `<config dir>/profiles/`. Safe to call from several threads (writes are serialized)."""

    def __init__(self, config_dir: Path | None = None) -> None:
        self.config_dir = Path(config_dir) if config_dir is not None else default_config_dir()
        self.profiles_dir = self.config_dir / "profiles"
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.profiles_dir / f"{check_name(name)}.toml"

    def names(self) -> list[str]:
        if not self.profiles_dir.is_dir():
            return []
        out = []
        for path in self.profiles_dir.glob("*.toml"):
            if not is_regular_file(path):
                continue  # a FIFO, a directory, a dangling link: not a profile, and a FIFO would block a read
            try:
                out.append(check_name(path.stem))
            except ConfigError:
                continue  # not a name this app would create; leave it alone
        return sorted(out)

    # --- reading -------------------------------------------------------------------------------------

    def read_text(self, name: str) -> str:
        path = self.path(name)
        try:
            return read_profile_text(path)
        except FileNotFoundError:
            raise ProfileError(path, "no such profile") from None
        except UnreadableProfile as exc:
            raise ProfileError(path, exc.reason) from None

    def load(self, name: str) -> Profile:
        """Read and validate one profile as it is on disk now; raises ProfileError (missing, broken)."""
        text = self.read_text(name)
        return replace(parse_profile(name, text, self.path(name)), origin=_digest(text))

    def load_all(self) -> list[Profile | ProfileError]:
        """Every profile in name order; a broken one comes back as its ProfileError."""
        out: list[Profile | ProfileError] = []
        for name in self.names():
            try:
                out.append(self.load(name))
            except ProfileError as exc:
                out.append(exc)
        return out

    # --- editing in place ----------------------------------------------------------------------------

    def update(self, name: str, changes: Changes | Callable[[Profile], Changes]) -> Profile:
        """Apply `changes` on top of the file as it is on disk now; returns the profile written. `changes`
        may be a function of the profile on disk (to compute a difference against it).

        Refuses (ProfileError naming the file) when the file is broken, or when the change would make it
        invalid together with what is on disk."""
        path = self.path(name)
        with self._lock, locked(path):
            text = self.read_text(name)
            try:
                before = replace(parse_profile(name, text, path), origin=_digest(text))
            except ProfileError as exc:
                raise ProfileError(path, f"not overwriting a broken profile (fix or delete it first): "
                                         f"{exc.message}", exc.line, exc.key) from None
            if callable(changes):
                changes = changes(before)
            doc = tomlkit.parse(text)
            for section, values in changes.items():
                for key, value in values.items():
                    _set_key(doc, section, key, value)
            new_text = tomlkit.dumps(doc)
            if new_text == text:
                return before
            try:
                profile = replace(parse_profile(name, new_text, path), origin=_digest(new_text))
            except ProfileError as exc:
                raise ProfileError(path, f"not saved: {exc.message}", None, exc.key) from None
            write_atomic(path, new_text)
            return profile

    def set_engine(self, name: str, **values: Any) -> Profile:
        return self.update(name, {"engine": values})

    def set_switch(self, name: str, switch: str, enabled: bool) -> Profile:
        return self.update(name, {"switches": {get_switch(switch).env_var: bool(enabled)}})

    def apply_edits(self, before: Profile, after: Profile) -> Profile:
        """Write what changed between `before` (what an editor was opened with) and `after` (what it
        holds now) onto the file as it is now; keys the editor did not change keep their disk values."""
        return self.update(after.name, diff_profiles(before, after))

    def save(self, profile: Profile) -> Path:
        """Make the file say what `profile` says: a new file, or only the differing keys of an existing one.
        A profile read from the file (load, update) is saved only while the file still holds the text it was
        read from: one read before another save would write that save's keys back to their old values (a lost
        update), so it is refused (ProfileChanged) and the caller reads the file again. `update` with a change
        computed from the disk is the path that never needs a retry."""
        path = self.path(profile.name)
        try:
            write_atomic(path, tomlkit.dumps(_new_document(profile)), exclusive=True)
        except FileExistsError:
            def changes(on_disk: Profile) -> Changes:
                if profile.origin is not None and on_disk.origin != profile.origin:
                    raise ProfileChanged(path)
                return diff_profiles(on_disk, profile)

            self.update(profile.name, changes)
        return path

    # --- whole files ---------------------------------------------------------------------------------

    def create(self, name: str, base: Profile | None = None) -> Profile:
        """A new profile (defaults, or `base`'s values) under a name nobody has taken, even concurrently."""
        profile = replace(base, name=name) if base is not None else Profile(name=check_name(name))
        self._create_file(name, tomlkit.dumps(_new_document(profile)))
        return self.load(name)

    def duplicate(self, source: str, new_name: str) -> Profile:
        """A copy of `source`'s file as written (comments included) under a new, untaken name."""
        self.load(source)  # refuse to copy a broken one
        self._create_file(new_name, self.read_text(source))
        return self.load(new_name)

    def _create_file(self, name: str, text: str) -> None:
        path = self.path(name)
        try:
            write_atomic(path, text, exclusive=True)
        except FileExistsError:
            raise ConfigError("name", name, f"a profile with this name exists ({path})") from None

    def rename(self, old: str, new: str) -> Path:
        """Rename the file (broken ones too: the content is left as it is); keeps `last used` pointing at it."""
        src, dst = self.path(old), self.path(new)
        if not src.exists():
            raise ProfileError(src, "no such profile")
        try:
            os.link(src, dst)  # fails if `new` exists, even one created a moment ago by someone else
        except FileExistsError:
            raise ConfigError("name", new, f"a profile with this name exists ({dst})") from None
        except OSError:  # no hard links here: check, then move
            if dst.exists():
                raise ConfigError("name", new, f"a profile with this name exists ({dst})") from None
            shutil.move(src, dst)
        else:
            src.unlink()
        if self.last_used() == old:
            self.set_last_used(new)
        return dst

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        if self.last_used() == name:
            (self.config_dir / _STATE_FILE).unlink(missing_ok=True)

    def remove_stale_temp_files(self, older_than_s: float = STALE_TEMP_S) -> list[Path]:
        """Delete temp files left by a save that was killed between writing and renaming."""
        removed = []
        now = time.time()
        for folder in (self.profiles_dir, self.config_dir):
            if not folder.is_dir():
                continue
            for path in folder.glob(f".*{TEMP_SUFFIX}"):
                try:
                    if now - path.stat().st_mtime >= older_than_s:
                        path.unlink()
                        removed.append(path)
                except OSError:
                    continue
        return removed

    # --- last used -----------------------------------------------------------------------------------

    def last_used(self) -> str | None:
        """The name in `state.toml`, read as a profile is (a FIFO there would block open() for ever, deaf to
        `q` and SIGTERM; a huge file would take seconds): None when it is not a small regular file naming one."""
        try:
            doc = tomllib.loads(read_profile_text(self.config_dir / _STATE_FILE, MAX_STATE_BYTES))
            return check_name(doc.get("last_profile"))
        except (OSError, UnreadableProfile, tomllib.TOMLDecodeError, RecursionError, ConfigError):
            return None

    def set_last_used(self, name: str) -> None:
        write_atomic(self.config_dir / _STATE_FILE, tomlkit.dumps({"last_profile": check_name(name)}))

    def open_initial(self, requested: str | None = None, write: bool = True) -> Profile | ProfileError:
        """The profile to open: `requested`, else the last used, else `default` (written on first run).
        `write=False` (attached to an engine elsewhere) only reads: no default file, no last-used change."""
        if not write:
            name = requested or self.last_used() or DEFAULT_PROFILE
            try:
                return self.load(name) if self.path(name).exists() else Profile(name=name)
            except ProfileError as exc:
                return exc
        self.remove_stale_temp_files()
        name = requested or self.last_used() or DEFAULT_PROFILE
        if name == DEFAULT_PROFILE and not self.path(name).exists():
            try:
                self.create(DEFAULT_PROFILE)
            except ConfigError:
                pass  # another process wrote it first: use theirs
        try:
            profile = self.load(name)
        except ProfileError as exc:
            return exc
        self.set_last_used(name)
        return profile


def diff_profiles(before: Profile, after: Profile) -> dict[str, dict[str, Any]]:
    """The keys whose values differ, as a change set (None = remove the key). A switch the file does not
    name runs at its default, so `after` naming it at that default is no change (an editor that shows every
    switch must not write the untouched ones)."""
    old, new = before.to_toml(), after.to_toml()
    changes: dict[str, dict[str, Any]] = {}
    for section in new:
        keys = set(old.get(section, {})) | set(new[section])
        for key in sorted(keys):
            was, now = old.get(section, {}).get(key), new[section].get(key)
            if section == "switches":
                default = get_switch(key).default
                was, now = (default if was is None else was), (default if now is None else now)
            if was != now:
                changes.setdefault(section, {})[key] = new[section].get(key)
    return changes


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _new_document(profile: Profile) -> tomlkit.TOMLDocument:
    doc = tomlkit.document()
    for section, values in profile.to_toml().items():
        table = tomlkit.table()
        for key, value in values.items():
            if value is not None:
                table[key] = value
        doc[section] = table
    return doc


def _set_key(doc: tomlkit.TOMLDocument, section: str, key: str, value: Any) -> None:
    """Set (or with None remove) one key, where the person wrote it: `kv-resident` stays spelled so."""
    table = doc.get(section)
    if table is None:
        if value is None:
            return
        table = tomlkit.table()
        doc[section] = table
    assert isinstance(table, (Table, dict)), f"[{section}] is not a table"
    spelled = next((k for k in (key, key.replace("_", "-")) if k in table), key)
    if value is None:
        if spelled in table:
            del table[spelled]
    else:
        table[spelled] = value
