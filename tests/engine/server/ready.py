"""The URL of `strata-engine serve`'s ready line, as a client of the process reads it."""

from __future__ import annotations

from engine.cli.serve import READY_PREFIX


def ready_line_url(line: str) -> str | None:
    """The URL of a ready line (its fourth word: what follows it describes the engine), or None for another line."""
    if not line.startswith(READY_PREFIX + " "):
        return None
    words = line.split()
    return words[3] if len(words) > 3 else None
