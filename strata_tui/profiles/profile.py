"""Profiles: named TOML files that say how to launch the engine and how the app behaves.

A profile lives at `<config dir>/profiles/<name>.toml` with three sections: `[engine]` (EngineConfig
fields, validated by `EngineConfig.from_mapping`), `[switches]` (`STRATA_* = bool`) and `[tui]` (refresh
interval, reserve steps). This module is the data and its validation; `store.py` reads and edits the
files. A file that does not parse or validate, for any reason, is a `ProfileError` with its path, line
and key.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from engine.config import BUILTIN_MODEL, EngineConfig
from engine.errors import ConfigError, StrataError
from engine.switches import get_switch
from strata_tui.profiles.kinds import ForeignEngine, env_table, parse_foreign

CONFIG_DIR_ENV = "STRATA_TUI_CONFIG_DIR"
DEFAULT_PROFILE = "default"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # always with fullmatch: "$" lets "name\n" in
_AT_LINE = re.compile(r"\s*\(at line (\d+), column (\d+)\)")
# A profile's keys are two deep (`engine.batch`); tomllib's time grows with the square of a dotted key's depth
# (50,000 levels: minutes), so a key nested deeper than this is refused before parsing.
MAX_KEY_DEPTH = 32
_KEY_PART = re.compile(r"^\s*(\[\[?[^\]]*|[^=\[]+=)")


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
    env: Mapping[str, str] = field(default_factory=dict)  # `[env]`: into the engine's environment
    foreign: ForeignEngine | None = None  # `[engine] kind = "vllm" | "sglang" | "llamacpp"` (profiles/kinds.py)
    # The digest of the file text this profile was read from (None: built in code). A save of a profile read
    # before the file changed is refused (ProfileStore.save): it would write stale values back.
    origin: str | None = field(default=None, compare=False, repr=False)

    def with_engine(self, **changes: Any) -> "Profile":
        """A copy with engine options changed (validated: raises ConfigError)."""
        return replace(self, engine=replace(self.engine, **changes))

    def with_switch(self, name: str, enabled: bool) -> "Profile":
        switches = dict(self.engine.switches)
        switches[get_switch(name).name] = enabled
        return self.with_engine(switches=switches)

    def to_toml(self) -> dict[str, dict[str, Any]]:
        """The TOML tables: every engine option that has a value (None = key absent), switches by
        variable, tui settings."""
        engine = {k: v for k, v in self.engine.to_dict(reveal_secrets=True).items() if k != "switches"}
        switches = {get_switch(n).env_var: bool(v) for n, v in sorted(self.engine.switches.items())}
        tui = {f.name: getattr(self.tui, f.name) for f in fields(self.tui)}
        if self.foreign is not None:
            return {"engine": self.foreign.to_table(), "env": dict(self.foreign.env), "tui": tui}
        return {"engine": engine, "switches": switches, "tui": tui, **({"env": dict(self.env)} if self.env else {})}


def default_config_dir() -> Path:
    """`$STRATA_TUI_CONFIG_DIR` when set (tests, portable installs), else the platform's config dir."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override)
    return Path(platformdirs.user_config_dir("strata-tui", appauthor=False))


def check_name(name: str) -> str:
    """A profile name becomes a file name: letters, digits, dot, dash, underscore; raises ConfigError."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError("name", name, "use 1-64 letters, digits, '.', '-' or '_', starting with a letter or digit")
    return name


def parse_profile(name: str, text: str, path: Path) -> Profile:
    """Parse and validate one profile's text; every failure is a ProfileError with path, line and key."""
    try:
        return _parse_profile(name, text, path)
    except ProfileError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a hand-edited file trips, it is listed as broken
        raise ProfileError(path, f"cannot read: {type(exc).__name__}: {exc}") from None


def _parse_profile(name: str, text: str, path: Path) -> Profile:
    _check_key_depth(text, path)
    try:
        doc = tomllib.loads(text)
    except RecursionError:  # 500-deep nested arrays: tomllib recurses once per level
        raise ProfileError(path, "nested too deeply to read (RecursionError)") from None
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
        if section not in ("engine", "switches", "tui", "env"):
            raise ProfileError(path, "unknown section; expected [engine], [switches], [tui], [env]",
                               _line_of(text, section, table=True), section)
    for section in ("engine", "switches", "tui", "env"):
        if not isinstance(doc.get(section, {}), dict):
            raise ProfileError(path, "expected a table", _line_of(text, section), section)
    engine_values = dict(doc.get("engine", {}))
    kind = engine_values.pop("kind", "strata")
    if kind != "strata":
        return _parse_foreign_profile(name, kind, engine_values, doc, text, path)
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
    try:
        env = env_table(doc.get("env", {}))
    except ConfigError as exc:
        raise ProfileError(path, f"{exc.reason} (value {exc.value!r})", _line_of(text, exc.param[4:]), exc.param) from None
    return Profile(name=name, engine=engine, tui=tui, env=env)


def _parse_foreign_profile(name: str, kind: Any, engine_values: dict, doc: dict, text: str, path: Path) -> Profile:
    """A vLLM / SGLang / llama.cpp profile: its own options (strata_tui/profiles/kinds.py); no Strata switches."""
    if doc.get("switches"):
        raise ProfileError(path, f"[switches] are Strata's; kind {kind!r} takes [env] and extra_args",
                           _line_of(text, "switches", table=True), "switches")
    try:
        foreign = parse_foreign(kind, engine_values, doc.get("env", {}))
        tui = TuiSettings.from_mapping(doc.get("tui", {}))
    except ConfigError as exc:
        param = exc.param if exc.param.startswith("env.") else f"engine.{exc.param}"
        section = "tui." if exc.param in {f.name for f in fields(TuiSettings)} else ""
        raise ProfileError(path, f"{exc.reason} (value {exc.value!r})", _line_of(text, exc.param.split(".")[-1]),
                           f"{section}{exc.param}" if section else param) from None
    return Profile(name=name, tui=tui, env=foreign.env, foreign=foreign)


def _check_key_depth(text: str, path: Path) -> None:
    """Refuse a key or table header with more than MAX_KEY_DEPTH dots, naming its line, before tomllib sees it."""
    for number, line in enumerate(text.splitlines(), start=1):
        match = _KEY_PART.match(line)
        if match and match.group(1).count(".") > MAX_KEY_DEPTH:
            depth = match.group(1).count(".") + 1
            raise ProfileError(path, f"a key nested {depth:,} levels deep (a profile's keys are two deep; "
                                     f"more than {MAX_KEY_DEPTH + 1} is refused unread)", number)


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
