"""`strata-engine quantize` writes its weights readable as its other files are (safetensors creates 0600)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(300)
def test_quantized_checkpoint_files_all_take_the_umasks_mode(tmp_path: Path) -> None:
    out = tmp_path / "q"
    done = subprocess.run([sys.executable, "-m", "engine.cli", "quantize", "--model", "builtin:strata-tiny",
                           "--format", "int4", "--out", str(out), "--device", "cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=280, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes or any(n.endswith(".safetensors") for n in modes), modes
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes
