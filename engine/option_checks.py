"""One option's value checked on its own, wherever it comes from (argv, a profile's TOML, a live route): whole
numbers in ASCII digits, finite floats, the ranges of the budgets that can change live, a TOML or argv value turned
into its field's type. Each failure is a ConfigError (an argparse error for argv) naming the option and the value.
Torch-free."""

from __future__ import annotations

import argparse
import math
from typing import Any, Mapping

from engine.errors import ConfigError

MAX_DIGITS = 20  # an integer option is ASCII digits, at most this many (a seed goes to 2^64 - 1) (int() of 5,000 digits is slow too)
VRAM_RESERVE_MAX_MIB = 1 << 20  # the reserve's range is 0..this, wherever it is set (CLI, profile, live route)
EXPERT_CACHE_MAX_MIB = 1 << 24  # an expert-cache budget's range is 1..this (CLI, profile, live route)


def check_positive(name: str, value: Any, upper: int | None = None, lower: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, "expected a whole number")
    if value < lower or (upper is not None and value > upper):
        bound = f"{lower}..{upper}" if upper is not None else f">= {lower}"
        raise ConfigError(name, value, f"expected {bound}")


def coerce_option(name: str, type_hint: Any, value: Any) -> Any:
    """Accept what TOML and argv give (ints, bools, strings) and turn mistakes into ConfigError."""
    hint = str(type_hint)
    if value is None:
        return None
    if hint.startswith("int | str"):  # a number or a word (expert_cache_mib: N or auto): validate() decides
        return value
    if hint.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ConfigError(name, value, "expected true or false")
    if hint.startswith("int"):
        if isinstance(value, bool):
            raise ConfigError(name, value, "expected a whole number")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and _decimal(value.strip()) is not None:
            return _decimal(value.strip())
        raise ConfigError(name, value, "expected a whole number (ASCII digits)")
    if hint.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(name, value, "expected a number")
    if hint.startswith("str"):
        if isinstance(value, str):
            return value or (None if "None" in hint else value)
        raise ConfigError(name, value, "expected a string")
    if hint.startswith("Mapping"):
        if isinstance(value, Mapping):
            return {str(k): bool(v) for k, v in value.items()}
        raise ConfigError(name, value, "expected a table of NAME = true/false")
    return value


def check_expert_cache_mib(value: Any, param: str = "mib", alternative: str = "") -> int:
    """An expert-cache budget's one range check (the CLI, a profile and the live route all go through it)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= EXPERT_CACHE_MAX_MIB:
        raise ConfigError(param, value, f"expected a whole number of MiB (1..{EXPERT_CACHE_MAX_MIB}){alternative}")
    return value


def check_vram_reserve_mib(value: Any) -> int:
    """The reserve's one range check (the CLI, a profile and the live route all go through it)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= VRAM_RESERVE_MAX_MIB:
        raise ConfigError("vram_reserve_mib", value, f"expected a whole number of MiB, 0..{VRAM_RESERVE_MAX_MIB}")
    return value


def _decimal(text: str) -> int | None:
    """The integer `text` spells in ASCII digits (an optional leading minus), else None: int() also reads
    Arabic-Indic, fullwidth and other Unicode digits, which no option means."""
    digits = text[1:] if text.startswith("-") else text
    if not 0 < len(digits) <= MAX_DIGITS or not digits.isascii() or not digits.isdigit():
        return None
    return int(text)


def whole_number(text: str) -> int:
    """An integer option (argparse type): ASCII digits only, at most MAX_DIGITS of them."""
    value = _decimal(text.strip())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a whole number in ASCII digits (at most {MAX_DIGITS}), "
                                         f"got {text[:40]!r}")
    return value


def finite_float(text: str) -> float:
    """A float option: NaN and infinities are refused (every comparison with NaN is False, so NaN would slip
    past each range check after it)."""
    try:
        if not text.isascii() or len(text) > 64:  # float() also reads Unicode digits
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
