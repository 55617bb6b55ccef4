"""The GPU session scripts name only what exists: every `engine.bench` command in them parses (its flags are
real), every test path is a file, every seed-scenario call parses. A device call is minutes of a scarce budget;
a typo found there costs one. Parsing only: nothing runs."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from engine.bench import command as cli_bench

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ["scripts/gpu_pending.sh", "scripts/gpu_attention.sh", "scripts/gpu_two.sh"]


def _commands(script: str) -> list[list[str]]:
    """Each command line of the script (continuations joined), split like the shell would; `${NAME:-default}`
    reads as its default, other variables stay as they are (a `$OUT/x.json` is a path like any other)."""
    text = (ROOT / script).read_text().replace("\\\n", " ")
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


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


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_command_in_the_gpu_scripts_parses(script: str) -> None:
    parser = _bench_parser()
    found = 0
    for words in _commands(script):
        args = _after(words, ["-m", "engine.bench"])
        if args is None:
            continue
        found += 1
        args = _shell_free(args)
        try:
            parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"{script}: `python -m engine.bench {' '.join(args)}` does not parse: {exc}")
    assert found, f"{script} runs no benchmark"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_test_path_in_the_gpu_scripts_exists(script: str) -> None:
    paths = re.findall(r"\btests/[\w/.-]+\.py\b", (ROOT / script).read_text())
    assert paths or script == "scripts/gpu_two.sh" or "GPU_TEST" in (ROOT / script).read_text()
    for path in paths:
        assert (ROOT / path).is_file(), f"{script} names {path}, which does not exist"


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
    for script in SCRIPTS:
        for words in _commands(script):
            args = _after(words, ["benchmarks/seed_scenario.py"])
            if args is not None:
                calls += 1
                parsed = module.parse_args(_shell_free(args))
                assert parsed.runs >= 1
    assert calls >= 2
