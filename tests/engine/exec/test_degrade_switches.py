"""Degrading the graph-related switches: COMPILE when torch.compile fails, CAPTURE_ALL when precapture does."""

from __future__ import annotations

import torch

from engine.exec.compile import StepCompiler
from tests.fault_injection import FaultPlan
from engine.exec.graphs.backends import CpuGraphBackend
from engine.exec.graphs.cache import GraphCache, GraphSpec
from engine.switches import SwitchBoard
from engine.telemetry import EventBus


def _step(ins):
    return {"y": ins["x"] * 3.0}


def _cache(switches: dict[str, bool], compile_fn=None, plan: str = "", **compile_kw) -> GraphCache:
    bus, board = EventBus(), SwitchBoard.from_values(switches)
    compiler = StepCompiler(board, bus, compile_fn=compile_fn, **compile_kw)
    return GraphCache("cpu", bus, board, lambda mib, reason: 0.0, wait_polls=1, wait_interval_s=0.0,
                      fault_plan=FaultPlan.parse(plan) if plan else FaultPlan(), backend=CpuGraphBackend(),
                      compiler=compiler, sleep=lambda s: None)


def _of_type(cache: GraphCache, kind: str) -> list:
    return [e for e in cache.bus.history() if e.type == kind]


def test_compile_off_leaves_the_step_alone() -> None:
    board = SwitchBoard.from_values({"COMPILE": False})
    compiler = StepCompiler(board, EventBus(), compile_fn=lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert compiler.prepare(_step) is _step and not compiler.active


def test_real_torch_compile_is_used_when_on() -> None:
    cache = _cache({"COMPILE": True}, options={"backend": "eager"})
    x = torch.arange(3.0)
    assert cache.run("decode", "b3", _step, {"x": x})["y"].tolist() == [0.0, 3.0, 6.0]
    assert cache.run("decode", "b3", _step, {"x": x + 1})["y"].tolist() == [3.0, 6.0, 9.0]
    assert cache.board.enabled("COMPILE") and _of_type(cache, "warning") == []


def test_compile_failing_at_wrap_degrades_once_and_the_graph_is_still_captured() -> None:
    def refuse(fn, **kwargs):
        raise RuntimeError(f"torch.compile is not supported with mode={kwargs['mode']}")

    cache = _cache({"COMPILE": True}, compile_fn=refuse)
    assert cache.run("decode", "b1", _step, {"x": torch.ones(1)})["y"].tolist() == [3.0]
    cache.run("decode", "b2", _step, {"x": torch.ones(2)})
    state = cache.board.states["COMPILE"]
    assert not state.enabled and state.degraded and "not supported with mode=default" in state.reason
    assert [(e.name, e.state) for e in _of_type(cache, "switch")] == [("COMPILE", "degraded")]
    (warning,) = _of_type(cache, "warning")
    assert "COMPILE turned off" in warning.message and "RuntimeError: torch.compile is not supported" in warning.message
    assert [e.action for e in _of_type(cache, "graph")] == ["capture", "capture"]


def test_compile_failing_at_first_call_falls_back_to_the_plain_step() -> None:
    calls = []

    def lazy_failure(fn, **kwargs):
        def compiled(ins):
            calls.append("compiled")
            raise RuntimeError("BackendCompilerFailed: backend='inductor' raised: CalledProcessError")
        return compiled

    cache = _cache({"COMPILE": True}, compile_fn=lazy_failure)
    out = cache.run("verify", "b1", _step, {"x": torch.full((2,), 2.0)})
    assert out["y"].tolist() == [6.0, 6.0] and calls == ["compiled"]
    assert cache.board.states["COMPILE"].degraded
    assert "BackendCompilerFailed" in cache.board.states["COMPILE"].reason
    assert cache.snapshot().degraded == []  # the graph is fine; only the switch went


def test_capture_all_precapture_failure_degrades_capture_all_not_the_step() -> None:
    cache = _cache({"CAPTURE_ALL": True}, plan="instantiate:verify:1-3:oom")
    specs = [GraphSpec("decode", "b1", _step, {"x": torch.ones(1)}),
             GraphSpec("verify", "b1", _step, {"x": torch.ones(1)}),
             GraphSpec("verify", "b2", _step, {"x": torch.ones(2)})]
    summary = cache.precapture(specs)
    assert summary["captured"] == 1
    state = cache.board.states["CAPTURE_ALL"]
    assert state.degraded and "precapture of verify b1" in state.reason and "out of memory" in state.reason
    assert len(_of_type(cache, "warning")) == 1
    # The step itself was not marked degraded: it is captured lazily when memory allows.
    assert cache.run("verify", "b1", _step, {"x": torch.ones(1)})["y"].tolist() == [3.0]
    # decode shares verify's owner (the runner), so the recovery had evicted it to make room.
    assert [(g.kind, g.key) for g in cache.snapshot().graphs] == [("verify", "b1")]
    assert [e.action for e in _of_type(cache, "graph")][:3] == ["capture", "evict", "retry"]
