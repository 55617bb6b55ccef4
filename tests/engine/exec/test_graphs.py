"""GraphCache capture, replay, accounting, release and snapshot, on the CPU graph backend."""

from __future__ import annotations

import pytest
import torch

from tests.fault_injection import ENV_VAR, FaultPlan, installed
from engine.exec.graphs.backends import CpuGraphBackend, default_backend
from engine.exec.graphs.cache import GraphCache, GraphSpec
from engine.switches import SwitchBoard
from engine.telemetry import EventBus

MIB_FLOATS = (1 << 20) // 4  # float32 elements in one MiB


def _cache(capacity_mib: float | None = None, **kw) -> GraphCache:
    return GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), lambda mib, reason: 0.0,
                      fault_plan=kw.pop("fault_plan", FaultPlan()), backend=CpuGraphBackend(capacity_mib),
                      wait_interval_s=0.0, sleep=lambda s: None, **kw)


def _affine(ins):
    return {"y": ins["x"] * 2.0 + 1.0, "n": ins["x"].shape[0]}


def _graph_events(cache: GraphCache) -> list[tuple[str, str, str]]:
    return [(e.action, e.kind, e.key) for e in cache.bus.history() if e.type == "graph"]


def test_replay_equals_eager_and_reuses_the_static_outputs() -> None:
    cache = _cache()
    assert all(callable(getattr(cache, name)) for name in ("run", "release", "invalidate", "snapshot"))
    first_x = torch.randn(8)
    first = cache.run("decode", ("b8",), _affine, {"x": first_x})
    assert torch.equal(first["y"], first_x * 2 + 1) and first["n"] == 8
    for _ in range(3):
        x = torch.randn(8)
        out = cache.run("decode", ("b8",), _affine, {"x": x})
        assert torch.equal(out["y"], x * 2 + 1)
        assert out["y"] is first["y"]  # the graph's static buffer, as the executor seam says
    assert _graph_events(cache) == [("capture", "decode", "(b8)")]
    (graph,) = cache.snapshot().graphs
    assert graph.replays == 3 and graph.kind == "decode" and graph.owner is None


def test_replay_reads_new_inputs_not_the_captured_ones() -> None:
    cache = _cache()
    calls = []

    def step(ins):
        calls.append(1)
        return {"y": ins["x"].cumsum(0)}

    cache.run("verify", "k", step, {"x": torch.ones(4)})
    out = cache.run("verify", "k", step, {"x": torch.arange(4.0)})
    assert out["y"].tolist() == [0.0, 1.0, 3.0, 6.0]


def test_mismatched_inputs_are_named_in_the_error() -> None:
    cache = _cache()
    cache.run("decode", ("b4",), _affine, {"x": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"decode graph \(b4\): input 'x' is \(5,\).*captured as \(4,\)"):
        cache.run("decode", ("b4",), _affine, {"x": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"inputs \['x', 'z'\] differ"):
        cache.run("decode", ("b4",), _affine, {"x": torch.zeros(4), "z": torch.zeros(1)})
    step = lambda ins: {"y": ins["x"] * ins["scale"]}  # noqa: E731
    cache.run("decode", "s", step, {"x": torch.ones(2), "scale": 3})
    assert cache.run("decode", "s", step, {"x": torch.ones(2), "scale": 3})["y"].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="non-tensor input 'scale' changed from 3 to 4"):
        cache.run("decode", "s", step, {"x": torch.ones(2), "scale": 4})


def test_a_broken_step_raises_its_own_error_not_a_degrade() -> None:
    cache = _cache()

    def broken(ins):
        raise IndexError("slot 7 out of range")

    with pytest.raises(IndexError, match="slot 7"):
        cache.run("decode", "b1", broken, {"x": torch.zeros(1)})
    assert _graph_events(cache) == [] and cache.snapshot().degraded == []
    with pytest.raises(TypeError, match="must return a dict of outputs, got Tensor"):
        cache.run("decode", "b2", lambda ins: ins["x"], {"x": torch.zeros(1)})


def test_memory_is_measured_per_graph_and_given_back_by_owner() -> None:
    cache = _cache(capacity_mib=100.0)
    x = torch.zeros(MIB_FLOATS)  # 1 MiB in, 1 MiB out: 2 MiB per graph
    cache.run("decode", "b1", _affine, {"x": x})
    cache.run("draft_round", "b1", _affine, {"x": x}, owner="drafter")
    cache.run("draft_step", ("b1", 1), _affine, {"x": x}, owner="drafter")
    snap = cache.snapshot()
    assert [g.mib for g in snap.graphs] == [2.0, 2.0, 2.0] and snap.total_mib == 6.0
    assert cache.release("drafter") == pytest.approx(4.0)
    assert [g.kind for g in cache.snapshot().graphs] == ["decode"]
    released = [(e.action, e.kind, e.mib) for e in cache.bus.history() if e.type == "graph" and e.action == "release"]
    assert released == [("release", "draft_round", 2.0), ("release", "draft_step", 2.0)]
    # A released graph is captured again on next need.
    cache.run("draft_round", "b1", _affine, {"x": x}, owner="drafter")
    assert cache.total_mib == pytest.approx(4.0)
    assert cache.release() == pytest.approx(4.0) and cache.snapshot().graphs == []


def test_invalidate_drops_only_matching_graphs() -> None:
    cache = _cache()
    for kind, key in (("decode", ("b1", "split")), ("decode", ("b1", "plain")), ("verify", ("b1", "split"))):
        cache.run(kind, key, _affine, {"x": torch.zeros(1)})
    cache.invalidate(lambda kind, key: "split" in key)
    assert [(g.kind, g.key) for g in cache.snapshot().graphs] == [("decode", "(b1, plain)")]


def test_precapture_captures_every_spec_once() -> None:
    cache = _cache()
    specs = [GraphSpec("decode", (f"b{b}",), _affine, {"x": torch.zeros(b)}) for b in (1, 2, 4)]
    summary = cache.precapture(specs + specs[:1])
    assert summary["captured"] == 3
    assert [a for a, _, _ in _graph_events(cache)] == ["capture"] * 3
    assert torch.equal(cache.run("decode", ("b2",), _affine, {"x": torch.ones(2)})["y"], torch.full((2,), 3.0))
    assert [a for a, _, _ in _graph_events(cache)] == ["capture"] * 3  # served from the precaptured graph


def test_the_product_reads_no_faults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "instantiate:decode:*:sticky")
    cache = GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), lambda mib, reason: 0.0, wait_polls=1,
                       wait_interval_s=0.0)
    assert cache.fault_plan is None
    assert torch.equal(cache.run("decode", "b1", _affine, {"x": torch.zeros(1)})["y"], torch.ones(1))


def test_faults_a_test_installs_reach_the_caches_built_without_a_plan() -> None:
    with installed("instantiate:decode:1:oom") as plan:
        cache = GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), lambda mib, reason: 0.0, wait_polls=1,
                           wait_interval_s=0.0)
        assert isinstance(cache.backend, CpuGraphBackend) and isinstance(default_backend("cpu"), CpuGraphBackend)
        cache.run("decode", "b1", _affine, {"x": torch.zeros(1)})
    assert cache.fault_plan is plan and plan.fired == ["instantiate:decode:1:oom"]
    after = GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), lambda mib, reason: 0.0)
    assert after.fault_plan is None  # uninstalled when the block ends
