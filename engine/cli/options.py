"""The model and engine options shared by serve, generate and bench, generated from EngineConfig's fields
(their metadata is each option's one description; strata-tui's profile editor reads the same)."""

from __future__ import annotations

import argparse
import math
import os

from engine.config import API_KEY_ENV, EngineConfig
from engine.errors import ConfigError
from engine.switches import switches_from_env

class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (`strata-engine serve: error: argument --x: ...`, exit 2), as every
    other start-up error of the CLI: the 15-line usage block buried the one line that said what was wrong."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(text: str) -> float:
    """A float option: NaN and infinities are refused (every comparison with NaN is False, so NaN would slip
    past each range check after it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


_TYPES = {"int": int, "int | None": int, "float": finite_float, "str": str, "str | None": str,
          "int | str | None": str}  # a number or a word (expert_cache_mib: N or auto): EngineConfig decides


def add_engine_options(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    defaults = EngineConfig()
    groups = {"engine": parser.add_argument_group("model and engine")}
    if serving:
        groups["server"] = parser.add_argument_group("server")
    for f in EngineConfig.options():
        meta = f.metadata
        group = groups.get(meta["group"])
        if group is None:
            continue
        default = getattr(defaults, f.name)
        if f.name == "api_key":
            default = os.environ.get(API_KEY_ENV)  # a key on argv would show in every process list
        shown = "" if default in (None, False) or meta["flag"] else f" (default {default})"
        opt = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            action = argparse.BooleanOptionalAction if meta["flag"] == "both" else "store_true"
            group.add_argument(opt, action=action, default=default, help=meta["help"] + shown)
        else:
            group.add_argument(opt, type=_TYPES[f.type], default=default, choices=meta["choices"],
                               metavar=meta["metavar"], help=meta["help"] + shown)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed options plus `STRATA_*` switches read from the environment."""
    try:
        switches = switches_from_env(os.environ)
    except ConfigError:
        raise
    values = {k: v for k, v in vars(args).items() if k in EngineConfig.__dataclass_fields__}
    if values.get("api_key") == "":
        # An empty key would serve without authentication while the caller believes a key is set.
        raise ConfigError("api_key", "", f"the key is empty (--api-key or {API_KEY_ENV}); unset {API_KEY_ENV} "
                                           f"and drop --api-key to serve without a key")
    return EngineConfig(**values, switches=switches)
