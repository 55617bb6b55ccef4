"""The strata-tui command line: options reach the app factory; bad values exit 2 with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from strata_tui.app import create_app
from strata_tui.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_options_parse() -> None:
    args = build_parser().parse_args(["--profile", "big", "--attach", "http://127.0.0.1:9000"])
    assert args.profile == "big" and args.attach == "http://127.0.0.1:9000"


def test_bad_attach_url_is_one_line_exit_2() -> None:
    out = subprocess.run([sys.executable, "-m", "strata_tui.cli", "--attach", "localhost:9000"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--attach" in out.stderr and "Traceback" not in out.stderr


def test_the_package_runs_as_the_script_does() -> None:
    import strata_tui

    out = subprocess.run([sys.executable, "-m", "strata_tui", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"strata-tui {strata_tui.__version__}"
    bad = subprocess.run([sys.executable, "-m", "strata_tui", "--attach", "localhost:9000"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--attach" in bad.stderr and "Traceback" not in bad.stderr


def test_factory_builds_attach_mode_without_launch(tmp_path: Path) -> None:
    app = create_app(config_dir=tmp_path, attach_url="http://127.0.0.1:9", sampler_factory=None)
    assert app.attach_url and not app.launch and app.view.mode == "attached"
