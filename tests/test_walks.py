"""The three walks of docs/ARCHITECTURE.md, counted from the running code by scripts/walk.py (every product file the
data passes through), held to docs/STYLE.md's limits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = re.compile(r"^\s*\|\s*(\w+):[^|]*\|\s*(\d+)\s*\|\s*$")
COUNT = re.compile(r"^(\w+): (\d+) files on the path")


def limits() -> dict[str, int]:
    """`| walk: what | N |` rows of docs/STYLE.md's table."""
    found = {}
    for line in (ROOT / "docs" / "STYLE.md").read_text().splitlines():
        match = LIMIT.match(line)
        if match:
            found[match[1]] = int(match[2])
    return found


def test_every_walk_stays_within_the_style_guides_limit() -> None:
    wanted = limits()
    assert set(wanted) == {"completions", "reserve", "telemetry"}, wanted
    out = subprocess.run([sys.executable, "scripts/walk.py", *wanted], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = {m[1]: int(m[2]) for m in map(COUNT.match, out.stdout.splitlines()) if m}
    assert set(counts) == set(wanted), out.stdout
    over = {name: (counts[name], limit) for name, limit in wanted.items() if counts[name] > limit}
    assert not over, f"walks over docs/STYLE.md's limits (files, limit): {over}\n{out.stdout}"
    # every file the data passes through, not only the stacks at a few stops: the scheduler that holds the prompt
    # and keeps its token, the detokenizer, the TUI's reducer and the monitor state the event is folded into
    for name, files in (("completions", ("engine/server/app.py", "engine/model/tokenizer.py", "engine/core/scheduler.py",
                                         "engine/exec/sampler.py", "engine/core/output.py")),
                        ("reserve", ("strata_tui/screens/monitor.py", "engine/exec/kv/vram_budget.py")),
                        ("telemetry", ("engine/orchestration/state.py", "strata_tui/state/reducer.py",
                                       "strata_tui/state/monitor_state.py", "strata_tui/widgets/slots_table.py"))):
        section = out.stdout.split(f"{name}: ")[1]
        assert all(f"  {path}" in section for path in files), section
