"""Bad starts of the real `strata-engine` CLI: one line on stderr naming the option (and what it accepts),
exit 2, never argparse's usage block, a NaN that slips past the range checks, an empty API key that turns
authentication off, or a load that hangs on a config.json that is a FIFO."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 90  # a start that is refused takes a second or two; one that hangs is what these tests catch


def _cli(*argv: str, env: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run([sys.executable, "-m", "engine.cli", *argv], cwd=ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"strata-engine {' '.join(argv)} did not stop within {timeout_s} s: it started "
                             f"(stderr: {exc.stderr!r:.400})") from None


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-800:])
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize(("argv", "needles"), [
    (["serve", "--kv-resident", "lots"], ["--kv-resident", "'lots'"]),
    (["serve", "--log-level", "loud"], ["--log-level", "'loud'", "'debug'", "'error'"]),  # the accepted values
    (["serve", "--no-such-option"], ["--no-such-option"]),
    (["bench"], ["required", "decode"]),
    (["generate", "--model", "builtin:strata-tiny"], ["--prompt"]),
])
def test_argument_errors_are_one_line_naming_the_option(argv, needles) -> None:
    line = _one_line_error(_cli(*argv), *needles)
    assert "usage:" not in line


@pytest.mark.parametrize(("argv", "option"), [
    (["serve", "--device", "cpu", "--port", "0", "--tier-wait-interval-s", "nan"], "--tier-wait-interval-s"),
    (["serve", "--device", "cpu", "--port", "0", "--tier-wait-interval-s", "inf"], "--tier-wait-interval-s"),
    (["generate", "--device", "cpu", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "--device", "cpu", "--prompt", "hi", "--top-p=-inf"], "--top-p"),
])
def test_nan_and_infinite_option_values_are_refused(argv, option) -> None:
    _one_line_error(_cli(*argv), option, "finite")


def test_an_empty_api_key_is_refused_not_taken_as_no_key() -> None:
    line = _one_line_error(_cli("serve", "--device", "cpu", "--port", "0", env={"STRATA_API_KEY": ""}),
                           "api_key", "empty")
    assert "STRATA_API_KEY" in line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_config_json_that_is_a_fifo_is_refused_not_waited_on(tmp_path) -> None:
    from engine.model.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "ckpt")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    _one_line_error(_cli("generate", "--model", str(model), "--device", "cpu", "--prompt", "hi"),
                    "config.json", "regular file")


def test_a_huge_config_json_is_refused(tmp_path) -> None:
    from engine.model.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "ckpt")
    with open(model / "config.json", "ab") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of NULs after the JSON
    _one_line_error(_cli("generate", "--model", str(model), "--device", "cpu", "--prompt", "hi"),
                    "config.json", "bytes")
    shutil.rmtree(model)


HUGE = "99999999999999999999999"


@pytest.mark.parametrize(("argv", "option"), [
    (["--queue-max", HUGE], "--queue-max"),
    (["--step-token-budget", HUGE], "--step-token-budget"),
    (["--tier-wait-polls", HUGE], "--tier-wait-polls"),
    (["--tier-wait-interval-s", HUGE], "--tier-wait-interval-s"),
    (["--prefill-chunk-tokens", HUGE], "--prefill-chunk-tokens"),
    (["--context", "٤"], "--context"),  # an Arabic-Indic four: int() takes it
    (["--batch", "²"], "--batch"),
    (["--port", "８０８０"], "--port"),  # fullwidth digits
])
def test_every_number_option_is_bounded_and_ascii(argv, option) -> None:
    """A start that accepted these served with a queue no memory holds, or read a digit no person typed."""
    line = _one_line_error(_cli("serve", "--device", "cpu", "--port", "0", *argv, timeout_s=30))
    assert option in line or option[2:].replace("-", "_") in line, line
    assert "usage:" not in line


@pytest.mark.parametrize("argv", [["--max-tokens", "٤"], ["--seed", HUGE + HUGE]])
def test_generate_numbers_are_ascii_and_bounded(argv) -> None:
    line = _one_line_error(_cli("generate", "--device", "cpu", "--prompt", "hi", *argv, timeout_s=30))
    assert argv[0] in line or argv[0][2:].replace("-", "_") in line, line
