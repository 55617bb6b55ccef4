"""Profiles: named TOML files that say how to launch the engine and how the app behaves.

A profile lives at `<config dir>/profiles/<name>.toml` with three sections: `[engine]` (EngineConfig
fields, validated by `EngineConfig.from_mapping`), `[switches]` (`STRATA_* = bool`) and `[tui]` (refresh
interval, reserve steps). Files are read with tomllib and written with tomli-w through a temp file, fsync
and os.replace, so a crash mid-write never leaves half a file. A file that does not parse or validate is
reported as a `ProfileError` with its path, line and key, and the store refuses to write over it.
"""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import platformdirs
import tomli_w

from engine.config import BUILTIN_MODEL, EngineConfig
from engine.errors import ConfigError, StrataError
from engine.switches import get_switch

CONFIG_DIR_ENV = "STRATA_TUI_CONFIG_DIR"
DEFAULT_PROFILE = "default"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_STATE_FILE = "state.toml"
_AT_LINE = re.compile(r"\s*\(at line (\d+), column (\d+)\)")


class ProfileError(StrataError):
    """A profile that cannot be used: names the file, the line (when known), the key and what is wrong."""

    def __init__(self, path: Path, message: str, line: int | None = None, key: str | None = None) -> None:
        self.path = Path(path)
        self.message = message
        self.line = line
        self.key = key
        where = f"{self.path}" + (f":{line}" if line else "")
        what = f"{key}: " if key else ""
        super().__init__(f"{where}: {what}{message}")


@dataclass(frozen=True)
class TuiSettings:
    """The `[tui]` section: how often the monitor redraws and how far the reserve keys move it."""

    refresh_s: float = 0.25
    reserve_step_mib: int = 64
    reserve_big_step_mib: int = 512

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TuiSettings":
        """Validate a `[tui]` table; raises ConfigError naming the key and value."""
        known = {"refresh_s", "reserve_step_mib", "reserve_big_step_mib"}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(key, value, f"unknown tui option; known: {', '.join(sorted(known))}")
        refresh_s = values.get("refresh_s", cls.refresh_s)
        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not 0.02 <= refresh_s <= 10:
            raise ConfigError("refresh_s", refresh_s, "expected a number of seconds in 0.02..10")
        steps = {}
        for key in ("reserve_step_mib", "reserve_big_step_mib"):
            value = values.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
                raise ConfigError(key, value, "expected a whole number of MiB in 1..65536")
            steps[key] = value
        return cls(refresh_s=float(refresh_s), **steps)


@dataclass(frozen=True)
class Profile:
    """One launch profile: the engine's options (switches included) and the app's own settings."""

    name: str
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model=BUILTIN_MODEL, device="auto"))
    tui: TuiSettings = field(default_factory=TuiSettings)

    def with_engine(self, **changes: Any) -> "Profile":
        """A copy with engine options changed (validated: raises ConfigError)."""
        return replace(self, engine=replace(self.engine, **changes))

    def with_switch(self, name: str, enabled: bool) -> "Profile":
        switches = dict(self.engine.switches)
        switches[get_switch(name).name] = enabled
        return self.with_engine(switches=switches)

    def to_toml(self) -> dict[str, Any]:
        """The TOML document: every engine option that has a value, switches by variable, tui settings."""
        engine = {k: v for k, v in self.engine.to_dict(reveal_secrets=True).items() if k != "switches" and v is not None}
        switches = {get_switch(n).env_var: bool(v) for n, v in sorted(self.engine.switches.items())}
        tui = {"refresh_s": self.tui.refresh_s, "reserve_step_mib": self.tui.reserve_step_mib,
               "reserve_big_step_mib": self.tui.reserve_big_step_mib}
        return {"engine": engine, "switches": switches, "tui": tui}


def default_config_dir() -> Path:
    """`$STRATA_TUI_CONFIG_DIR` when set (tests, portable installs), else the platform's config dir."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override)
    return Path(platformdirs.user_config_dir("strata-tui", appauthor=False))


def check_name(name: str) -> str:
    """A profile name becomes a file name: letters, digits, dot, dash, underscore; raises ConfigError."""
    if not _NAME_RE.match(name or ""):
        raise ConfigError("name", name, "use 1-64 letters, digits, '.', '-' or '_', starting with a letter or digit")
    return name


def parse_profile(name: str, text: str, path: Path) -> Profile:
    """Parse and validate one profile's text; every failure is a ProfileError with path, line and key."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # Python < 3.14 has no lineno/colno attributes: the message ends with "(at line L, column C)".
        line = getattr(exc, "lineno", None)
        match = _AT_LINE.search(str(exc))
        if line is None and match:
            line = int(match.group(1))
        message = _AT_LINE.sub("", str(exc)).strip()
        column = f" (column {match.group(2)})" if match else ""
        raise ProfileError(path, f"{message}{column}", line=line) from None
    for section in doc:
        if section not in ("engine", "switches", "tui"):
            raise ProfileError(path, "unknown section; expected [engine], [switches], [tui]",
                               _line_of(text, section, table=True), section)
    for section in ("engine", "switches", "tui"):
        if not isinstance(doc.get(section, {}), dict):
            raise ProfileError(path, "expected a table", _line_of(text, section), section)
    engine_values = dict(doc.get("engine", {}))
    switches: dict[str, bool] = {}
    for var, value in doc.get("switches", {}).items():
        key = f"switches.{var}"
        try:
            switch = get_switch(var)
        except StrataError as exc:
            raise ProfileError(path, str(exc), _line_of(text, var), key) from None
        if not isinstance(value, bool):
            raise ProfileError(path, f"expected true or false, got {value!r}", _line_of(text, var), key)
        switches[switch.name] = value
    try:
        engine = EngineConfig.from_mapping({**engine_values, "switches": switches})
    except ConfigError as exc:
        raise ProfileError(path, f"{exc.reason} (value {exc.value!r})", _line_of(text, exc.param),
                           f"engine.{exc.param}") from None
    try:
        tui = TuiSettings.from_mapping(doc.get("tui", {}))
    except ConfigError as exc:
        raise ProfileError(path, f"{exc.reason} (value {exc.value!r})", _line_of(text, exc.param),
                           f"tui.{exc.param}") from None
    return Profile(name=name, engine=engine, tui=tui)


def _line_of(text: str, key: str, table: bool = False) -> int | None:
    """The 1-based line where `key = ...` (or `[key]`) is written, so a bad value points at its line."""
    spellings = {key, key.replace("_", "-")}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        for spelling in spellings:
            if table and stripped.startswith(f"[{spelling}]"):
                return number
            if re.match(rf"^{re.escape(spelling)}\s*=", stripped) or stripped.startswith(f"[{spelling}]"):
                return number
    return None


def atomic_write_toml(path: Path, doc: Mapping[str, Any]) -> None:
    """Write TOML through a temp file in the same directory, fsync it, then os.replace it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = tomli_w.dumps(dict(doc)).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable where the platform allows opening a directory
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


class ProfileStore:
    """The profiles directory: list, load, save, create, duplicate, rename, delete, and the last one used."""

    def __init__(self, config_dir: Path | None = None) -> None:
        self.config_dir = Path(config_dir) if config_dir is not None else default_config_dir()
        self.profiles_dir = self.config_dir / "profiles"

    def path(self, name: str) -> Path:
        return self.profiles_dir / f"{check_name(name)}.toml"

    def names(self) -> list[str]:
        if not self.profiles_dir.is_dir():
            return []
        return sorted(p.stem for p in self.profiles_dir.glob("*.toml") if _NAME_RE.match(p.stem))

    def load(self, name: str) -> Profile:
        """Read and validate one profile; raises ProfileError (missing, unreadable, broken)."""
        path = self.path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileError(path, "no such profile") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(path, f"cannot read: {exc}") from None
        return parse_profile(name, text, path)

    def load_all(self) -> list[Profile | ProfileError]:
        """Every profile in name order; a broken one comes back as its ProfileError."""
        out: list[Profile | ProfileError] = []
        for name in self.names():
            try:
                out.append(self.load(name))
            except ProfileError as exc:
                out.append(exc)
        return out

    def save(self, profile: Profile) -> Path:
        """Write a profile atomically. Refuses to replace a file that exists but does not parse."""
        path = self.path(profile.name)
        if path.exists():
            try:
                self.load(profile.name)
            except ProfileError as exc:
                raise ProfileError(path, f"not overwriting a broken profile (fix or delete it first): "
                                         f"{exc.message}", exc.line, exc.key) from None
        atomic_write_toml(path, profile.to_toml())
        return path

    def create(self, name: str, base: Profile | None = None) -> Profile:
        """A new profile (defaults, or a copy of `base`) under a name not yet taken."""
        path = self.path(name)
        if path.exists():
            raise ConfigError("name", name, f"a profile with this name exists ({path})")
        profile = replace(base, name=name) if base is not None else Profile(name=name)
        self.save(profile)
        return profile

    def duplicate(self, source: str, new_name: str) -> Profile:
        return self.create(new_name, base=self.load(source))

    def rename(self, old: str, new: str) -> Path:
        """Rename the file (broken ones too: the content is left as it is); keeps `last used` pointing at it."""
        src, dst = self.path(old), self.path(new)
        if not src.exists():
            raise ProfileError(src, "no such profile")
        if dst.exists():
            raise ConfigError("name", new, f"a profile with this name exists ({dst})")
        os.replace(src, dst)
        if self.last_used() == old:
            self.set_last_used(new)
        return dst

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        if self.last_used() == name:
            (self.config_dir / _STATE_FILE).unlink(missing_ok=True)

    def last_used(self) -> str | None:
        try:
            doc = tomllib.loads((self.config_dir / _STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            return None
        name = doc.get("last_profile")
        return name if isinstance(name, str) and _NAME_RE.match(name) else None

    def set_last_used(self, name: str) -> None:
        atomic_write_toml(self.config_dir / _STATE_FILE, {"last_profile": check_name(name)})

    def open_initial(self, requested: str | None = None) -> Profile | ProfileError:
        """The profile to open: `requested`, else the last used, else `default` (written on first run)."""
        name = requested or self.last_used() or DEFAULT_PROFILE
        if name == DEFAULT_PROFILE and not self.path(name).exists():
            self.save(Profile(name=DEFAULT_PROFILE))
        try:
            profile = self.load(name)
        except ProfileError as exc:
            return exc
        self.set_last_used(name)
        return profile
