"""Docs are for users and code says why, not when: the history of past runs lives in git. Dates and run logs in
comments, strings or docs go stale the day they are written (the switch effects reach the TUI over the wire)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"20\d\d-[01]\d-[0-3]\d")
SESSION = re.compile(r"(first|second|third|fourth|fifth|[a-z]+th) session|gpu session|session of 20", re.I)


def test_no_code_line_quotes_a_date_or_a_past_session() -> None:
    found = []
    for folder in ("engine", "strata_tui"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if DATE.search(line) or SESSION.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_no_user_doc_narrates_past_sessions() -> None:
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in docs for number, line in enumerate(path.read_text().splitlines(), 1)
             if SESSION.search(line)]
    assert not found, "\n".join(found[:20])
