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


# Where a doc may carry a date: a log line's timestamp (above), a release's heading in the changelog, and the one
# line of a benchmark's table that says when it was measured.
RELEASE = re.compile(r"^## \[[^\]]+\] - 20\d\d-[01]\d-[0-3]\d$")
MEASURED = "Measured"
COMMIT = re.compile(r"\bcommits? [0-9a-f]{7,40}\b")
BENCHMARKS_MAX_LINES = 400


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each block of non-blank lines."""
    found, start, lines = [], 0, []
    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.strip():
            start = start or number
            lines.append(line.strip())
        elif lines:
            found.append((start, " ".join(lines)))
            start, lines = 0, []
    return found


def test_no_user_doc_dates_a_run_except_where_a_benchmark_says_when_it_was_measured() -> None:
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for path in docs:
        name = str(path.relative_to(ROOT))
        for number, paragraph in _paragraphs(path.read_text()):
            dates = DATE.findall(TIMESTAMP.sub("", paragraph))
            if not dates or (name == "CHANGELOG.md" and RELEASE.match(paragraph)):
                continue
            if name == "docs/BENCHMARKS.md" and paragraph.startswith(MEASURED) and len(dates) == 1:
                continue
            found.append(f"{name}:{number}: {paragraph[:160]}")
    assert not found, "dates in docs (history lives in git; a benchmark's table says once when it was measured):\n" \
        + "\n".join(found[:20])


def test_benchmarks_hold_one_current_table_each_and_no_commits() -> None:
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= BENCHMARKS_MAX_LINES
    assert not COMMIT.findall(text), "commits in docs/BENCHMARKS.md: git knows which code ran"
    paragraphs = _paragraphs(text)
    for index, (number, paragraph) in enumerate(paragraphs):
        if paragraph.startswith(MEASURED):
            assert len(DATE.findall(paragraph)) == 1, f"docs/BENCHMARKS.md:{number}: one date, the measurement's"
    # every table has one line that says how it was measured (the command, the machine, the date), just above it
    for index, (number, paragraph) in enumerate(paragraphs):
        if paragraph.startswith("|") and index and not paragraphs[index - 1][1].startswith(MEASURED):
            raise AssertionError(f"docs/BENCHMARKS.md:{number}: a table without its Measured line above it")
