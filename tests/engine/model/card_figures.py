"""The model card's figures table read back (the tests check a trained card against its own figures)."""

from __future__ import annotations

import re
from pathlib import Path

from engine.train.card import FIGURE_ROWS


def read_card_figures(path: Path) -> dict[str, dict[str, float]]:
    """{"sample": {...}, "full": {...}} with the EvalFigures keys, parsed from the card's figures table."""
    text = path.read_text()
    found: dict[str, dict[str, float]] = {"sample": {}, "full": {}}
    for label, key in FIGURE_ROWS:
        match = re.search(rf"^\| {re.escape(label)} \| ([0-9.,]+) \| ([0-9.,]+) \|$", text, flags=re.MULTILINE)
        if match is None:
            raise ValueError(f"{path}: no figures row {label!r}")
        found["sample"][key] = float(match.group(1).replace(",", ""))
        found["full"][key] = float(match.group(2).replace(",", ""))
    return found
