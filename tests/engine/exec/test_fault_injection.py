"""The fault-injection plan (tests/fault_injection.py): grammar, counting, real error types, and how a test
installs it in an engine process it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.errors import ConfigError
from tests.fault_injection import ENV_VAR, FaultPlan, engine_process_env


def _fires(plan: FaultPlan, stage: str, kind: str) -> BaseException | None:
    try:
        plan.check(stage, kind)
    except BaseException as exc:  # noqa: BLE001 - the injected errors are what is under test
        return exc
    return None


def test_nth_attempt_of_one_kind_and_stage_only() -> None:
    plan = FaultPlan.parse("capture:draft_round:2:oom")
    assert _fires(plan, "capture", "draft_round") is None
    assert _fires(plan, "capture", "decode") is None  # other kinds count separately
    assert _fires(plan, "instantiate", "draft_round") is None  # other stages too
    exc = _fires(plan, "capture", "draft_round")
    assert isinstance(exc, torch.OutOfMemoryError) and "[injected capture:draft_round:2:oom" in str(exc)
    assert _fires(plan, "capture", "draft_round") is None
    assert plan.fired == ["capture:draft_round:2:oom"]
    assert plan.attempts("capture", "draft_round") == 3


def test_ranges_open_ranges_and_wildcards() -> None:
    plan = FaultPlan.parse("instantiate:verify:2-3:oom, instantiate:decode:2+:sticky, capture:*:*:empty")
    got = [_fires(plan, "instantiate", "verify") is not None for _ in range(4)]
    assert got == [False, True, True, False]
    got = [_fires(plan, "instantiate", "decode") is not None for _ in range(4)]
    assert got == [False, True, True, True]
    assert all(_fires(plan, "capture", k) is not None for k in ("decode", "draft_step"))


def test_errors_are_the_types_and_messages_cuda_really_raises() -> None:
    plan = FaultPlan.parse("instantiate:verify:1:oom,capture:verify:1:invalidated,capture:decode:1:no_error,"
                           "instantiate:decode:1:sticky")
    inst = _fires(plan, "instantiate", "verify")
    assert type(inst) is RuntimeError and str(inst).startswith("CUDA error: out of memory")
    inv = _fires(plan, "capture", "verify")
    assert "previous error during capture" in str(inv) and isinstance(inv.__cause__, torch.OutOfMemoryError)
    noerr = _fires(plan, "capture", "decode")
    assert "no error" in str(noerr) and isinstance(noerr.__context__, torch.OutOfMemoryError)
    assert "illegal memory access" in str(_fires(plan, "instantiate", "decode"))


@pytest.mark.parametrize("spec, fragment", [
    ("capture:draft_round:1", "expected stage:kind:when:error"),
    ("replay:decode:1:oom", "stage 'replay'"),
    ("capture:decode:1:segfault", "error 'segfault'"),
    ("capture:decode:0:oom", "attempts count from 1"),
    ("capture:decode:3-2:oom", "N-M needs M >= N"),
    ("capture:decode:x:oom", "when 'x'"),
    ("capture::1:oom", "kind is empty"),
])
def test_bad_rules_name_the_variable_and_the_rule(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        FaultPlan.parse(spec)
    assert err.value.param == ENV_VAR and fragment in str(err.value)


def test_from_env() -> None:
    assert FaultPlan.from_env({}) is None
    plan = FaultPlan.from_env({ENV_VAR: "capture:draft_round:1:oom,instantiate:verify:2:sticky"})
    assert plan is not None and [r.spec() for r in plan.rules] == ["capture:draft_round:1:oom",
                                                                   "instantiate:verify:2:sticky"]


def test_an_engine_process_a_test_starts_gets_the_plan_and_a_plain_one_does_not() -> None:
    code = ("import engine.exec.graphs.cache as c; p = c.installed_faults; "
            "print(None if p is None else ','.join(r.spec() for r in p.rules))")
    root = Path(__file__).resolve().parents[3]
    env = engine_process_env("capture:decode:1:sticky")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "capture:decode:1:sticky"
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the variable alone: the engine ignores it
    out = subprocess.run([sys.executable, "-c", code], env=plain, cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_a_malformed_plan_fails_in_the_test_not_in_the_engine_process() -> None:
    with pytest.raises(ConfigError):
        engine_process_env("capture:decode:oops")
