"""`strata-engine --version` answers as `strata-tui --version` does: the program and its version, exit 0."""

from __future__ import annotations

import subprocess
import sys

from engine import __version__


def test_strata_engine_version_prints_the_version_and_exits_zero() -> None:
    done = subprocess.run([sys.executable, "-m", "engine.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"strata-engine {__version__}"
