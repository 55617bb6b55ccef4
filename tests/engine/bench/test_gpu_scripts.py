"""The GPU run (benchmarks/run_all_gpu.sh) names only what exists: every `engine.bench` command in it parses (its
flags are real), every test path is a file, every seed-scenario call parses, every step it runs is listed and a
step name it does not know is refused. A device call is minutes of a scarce budget; a typo found there costs one.
Parsing only: nothing runs on a GPU."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from engine.bench import command as cli_bench

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = "benchmarks/run_all_gpu.sh"


def _expanded(text: str) -> str:
    """The script's text with its variables read as their defaults: `${NAME:-default}` as default, `NAME=(...)`
    arrays as their words (the first assignment), `$NAME` as the default its `NAME=${NAME:-...}` line gives."""
    text = text.replace("\\\n", " ")
    arrays: dict[str, str] = {}
    for name, words in re.findall(r"^(\w+)=\((.*)\)$", text, flags=re.M):
        arrays.setdefault(name, words)
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}$]*)\}$", text, flags=re.M))
    text = re.sub(r'"?\$\{(\w+)\[@\]\}"?', lambda m: arrays.get(m.group(1), ""), text)
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), text)


def _commands(script: str) -> list[list[str]]:
    """Each step call of the script (`run NAME LIMIT_S ...`, `step NAME LIMIT_S ...`, `pytest_step NAME LIMIT_S ...`;
    continuations joined, variables at their defaults), split like the shell."""
    text = _expanded((ROOT / script).read_text())
    return [shlex.split(line, comments=True) for line in text.splitlines()
            if not line.lstrip().startswith("#") and re.search(r"(^|\s)(run|step|pytest_step)\s+\w+\s+\d+\s", line)]


def _steps(words: list[str]) -> tuple[str, str, list[str]] | None:
    """A `run`, `step` or `pytest_step NAME LIMIT_S ...` call: (function, name, the rest)."""
    for i, word in enumerate(words[:-2]):
        if word in ("run", "step", "pytest_step") and words[i + 2].isdigit():
            return word, words[i + 1], words[i + 3:]
    return None


def _after(words: list[str], marker: list[str]) -> list[str] | None:
    for i in range(len(words) - len(marker) + 1):
        if words[i:i + len(marker)] == marker:
            return words[i + len(marker):]
    return None


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", exit_on_error=False)
    cli_bench.add_arguments(parser)
    return parser


def _shell_free(words: list[str]) -> list[str]:
    """Drop redirections and what follows a pipe; a `$OUT/...` path is a path like any other."""
    out = []
    for word in words:
        if word in ("|", "&&", ";") or word.startswith((">", "2>")):
            break
        out.append(word)
    return out


def test_every_bench_step_of_the_gpu_run_parses() -> None:
    parser = _bench_parser()
    found = 0
    for words in _commands(SCRIPT):
        call = _steps(words)
        if call is None or call[0] != "run":
            continue
        found += 1
        args = _shell_free(call[2])
        try:
            parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"{SCRIPT} step {call[1]}: `python -m engine.bench {' '.join(args)}` does not parse: {exc}")
    assert found >= 30, f"{SCRIPT} runs {found} benchmarks"


def test_every_test_path_in_the_gpu_run_exists() -> None:
    paths = re.findall(r"\btests/[\w/.-]+\.py\b", (ROOT / SCRIPT).read_text())
    assert paths
    for path in paths:
        assert (ROOT / path).is_file(), f"{SCRIPT} names {path}, which does not exist"


def test_every_step_is_listed_and_every_listed_step_runs() -> None:
    listed = subprocess.run(["bash", str(ROOT / SCRIPT), "--list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    called = [call[1] for words in _commands(SCRIPT) if (call := _steps(words))]
    assert sorted(names) == sorted(set(called)) and len(called) == len(set(called))


def test_an_unknown_step_is_refused_by_name_before_anything_runs(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(ROOT / SCRIPT), "decode,no_such_step"], env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert "no_such_step" in proc.stderr and "peers_static" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_seed_scenario_calls_in_the_gpu_scripts_parse() -> None:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("seed_scenario", ROOT / "benchmarks" / "seed_scenario.py")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    calls = 0
    for words in _commands(SCRIPT):
        args = _after(words, ["benchmarks/seed_scenario.py"])
        if args is not None:
            calls += 1
            parsed = module.parse_args(_shell_free(args))
            assert parsed.runs >= 1
    assert calls >= 4
