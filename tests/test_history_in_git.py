"""Docs are for users and code says why, not when: the history of past runs lives in git. Dates and run logs in
comments, strings or docs go stale the day they are written (the switch effects reach the TUI over the wire).
Tests, benchmarks and scripts are code too."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"20\d\d-[01]\d-[0-3]\d")
SESSION = re.compile(r"(first|second|third|fourth|fifth|[a-z]+th) session|gpu session|session of 20", re.I)


# A date followed by a time of day is a log line's timestamp: test input, as is a person's profile under test.
TIMESTAMP = re.compile(r"20\d\d-[01]\d-[0-3]\d[ T]\d\d:\d\d|\[20\d\d-[01]\d-[0-3]\d|20\d\d-[01]\d-[0-3]\d INFO")
INPUT_FILES = {"tests/tui/test_profile_edits.py": "a hand-written profile's comments are the input under test",
               "tests/test_history_in_git.py": "the patterns themselves"}


def test_no_code_line_quotes_a_date_or_a_past_session() -> None:
    found = []
    for folder in ("engine", "strata_tui", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            name = str(path.relative_to(ROOT))
            if path.suffix not in (".py", ".sh") or name in INPUT_FILES or "__snapshots__" in name:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if (DATE.search(TIMESTAMP.sub("", line)) or SESSION.search(line)):
                    found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_no_user_doc_narrates_past_sessions() -> None:
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in docs for number, line in enumerate(path.read_text().splitlines(), 1)
             if SESSION.search(line)]
    assert not found, "\n".join(found[:20])
