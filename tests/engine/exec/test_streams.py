"""The one owner of the engine's CUDA streams and of each launch's split-counter lane (engine.exec.cuda_streams): which
stream and lane each user gets, that the engine builder makes exactly one and hands it down, and that nothing else
in the engine makes a stream or sets a lane. The CUDA streams themselves: the `gpu` tests at the end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.exec.graphs.backends import default_backend
from engine.exec.cuda_streams import Streams
from tests.engine.engine_helpers import make_engine, shared_lively_checkpoint

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")
OWNER = ROOT / "engine" / "exec" / "streams.py"


def test_on_a_cpu_there_is_no_stream_and_on_changes_nothing() -> None:
    streams = Streams(CPU, overlap=True, chunk_sms=64)
    assert (streams.steps, streams.side, streams.capture, streams.kv_copy, streams.expert_copy) == (None,) * 5
    assert streams.chunk_sms == 0 and streams.note is None
    for work, beside in (("steps", False), ("chunks", False), ("chunks", True)):
        with streams.on(work, beside):
            pass


def test_each_user_runs_on_its_own_stream() -> None:
    streams = Streams(CPU, overlap=True)
    streams.steps, streams.side = "steps stream", "side stream"  # what CUDA would hold
    assert streams.stream_of("steps") == "steps stream"
    assert streams.stream_of("chunks", beside=True) == "side stream"
    assert streams.stream_of("chunks") is None  # a chunk between the steps: the current (the steps') stream


def test_a_prompt_chunk_uses_the_chunks_lane_only_beside_the_steps() -> None:
    beside = Streams(CPU, overlap=True)
    assert (beside.lane_of("steps"), beside.lane_of("chunks", beside=True)) == ("steps", "chunks")
    # a chunk between the steps runs in order with them: the steps' lane
    assert beside.lane_of("chunks") == "steps"
    alone = Streams(CPU, overlap=False)  # one stream runs everything in order: one lane serves
    assert (alone.lane_of("steps"), alone.lane_of("chunks", beside=True)) == ("steps", "steps")
    with pytest.raises(ValueError, match="unknown work 'decode'"):
        beside.lane_of("decode")
    with pytest.raises(ValueError, match="unknown work 'decode'"):
        beside.stream_of("decode")


def test_the_owner_knows_every_lane_the_kernels_keep_counters_for() -> None:
    pytest.importorskip("triton")
    from engine.exec.cuda_streams import LANES
    from engine.model.triton_linear import COUNTER_LANES

    assert LANES == COUNTER_LANES


def test_on_sets_the_lane_the_kernels_read_and_puts_it_back() -> None:
    """The skinny matmul's split counters (what a launch deep in the model reads) follow `on`: a chunk beside the
    steps has the chunks lane's array; after it, the steps lane's again. A chunk between the steps runs in order
    with the steps and keeps their array, so the chunks lane's has one user, the side stream."""
    pytest.importorskip("triton")
    from engine.model.triton_linear import split_counters

    streams = Streams(CPU, overlap=True)
    streams.cuda = True  # the lane is set on CUDA only; a chunk between the steps switches no stream
    steps_counters = split_counters(CPU, "steps")
    with streams.on("chunks", beside=True):
        in_flight = split_counters(CPU)
        assert in_flight is split_counters(CPU, "chunks") is not steps_counters
    with streams.on("chunks"):
        assert split_counters(CPU) is steps_counters is not in_flight
    assert split_counters(CPU) is steps_counters
    streams.overlap = False
    with streams.on("chunks", beside=True):
        assert split_counters(CPU) is steps_counters


def test_the_engine_builder_makes_one_and_hands_it_to_every_user(tiny_checkpoint: Path, monkeypatch) -> None:
    import engine.orchestration.engine_setup as setup

    made: list[Streams] = []

    class Counted(Streams):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(setup, "Streams", Counted)
    engine = make_engine(tiny_checkpoint, prefill_overlap="on")
    try:
        assert made == [engine.streams] and engine.streams.overlap
        assert engine.executor.streams is engine.streams and engine.chunks.streams is engine.streams
    finally:
        engine.close()
    made.clear()
    engine = make_engine(tiny_checkpoint, prefill_overlap="off")
    try:
        assert made == [engine.streams] and not engine.streams.overlap and engine.chunks is None
    finally:
        engine.close()


def test_cuda_components_refuse_to_run_without_the_engines_streams() -> None:
    with pytest.raises(ValueError, match="device='cuda:0' needs the engine's streams"):
        default_backend("cuda:0")


def _calls(pattern: str) -> list[str]:
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_only_the_owner_makes_a_stream() -> None:
    makes = _calls(r"\bStream\(")  # torch.cuda.Stream(...) and a green context's context.Stream()
    assert makes and all(m.startswith("engine/exec/cuda_streams.py:") for m in makes), makes


def test_only_the_owner_sets_a_lane() -> None:
    sets = [c for c in _calls(r"\bcounter_lane\(") if not c.startswith("engine/model/triton_linear.py:")]
    assert sets and all(c.startswith("engine/exec/cuda_streams.py:") for c in sets), sets


# --- CUDA --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_every_user_runs_on_the_owners_stream(ckpt: Path) -> None:
    engine = make_engine(ckpt, device="cuda:0", dtype="bfloat16", batch=2, kv_resident=64, prefill_overlap="auto")
    try:
        streams = engine.streams
        kinds = (streams.steps, streams.side, streams.capture, streams.kv_copy, streams.expert_copy)
        assert all(s is not None for s in kinds)
        assert len({s.cuda_stream for s in kinds}) == len(kinds), "five distinct streams"
        assert streams.steps.priority < streams.side.priority or streams.chunk_sms > 0
        assert engine.graphs.backend._stream is streams.capture
        assert engine.kv.paging._copy_stream is streams.kv_copy
        assert engine.chunks.streams is streams
    finally:
        engine.close()


@pytest.mark.gpu
def test_gpu_on_switches_the_stream_and_the_lane_together() -> None:
    from engine.model.triton_linear import split_counters

    device = torch.device("cuda", 0)
    streams = Streams(device, overlap=True, chunk_sms=0)  # the plain low-priority side stream
    outer = torch.cuda.current_stream(device)
    steps_counters = split_counters(device, "steps")
    with streams.on("steps"):
        assert torch.cuda.current_stream(device) == streams.steps and split_counters(device) is steps_counters
    with streams.on("chunks", beside=True):
        assert torch.cuda.current_stream(device) == streams.side
        assert split_counters(device) is split_counters(device, "chunks")
    with streams.on("chunks"):  # between the steps: the caller's stream, the steps' lane
        assert torch.cuda.current_stream(device) == outer
        assert split_counters(device) is steps_counters
    assert torch.cuda.current_stream(device) == outer and split_counters(device) is steps_counters
    alone = Streams(device)
    assert alone.steps is None and alone.side is None and alone.capture is not None


@pytest.mark.gpu
def test_gpu_the_expert_cache_loads_on_the_owners_copy_stream(tmp_path_factory) -> None:
    moe_ckpt = shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")
    engine = make_engine(moe_ckpt, device="cuda:0", dtype="float32", batch=2)
    try:
        assert engine.lm.model.expert_provider.copy_stream is engine.streams.expert_copy
        assert engine.chunks is None and engine.streams.steps is None  # MoE: no chunks beside the steps
    finally:
        engine.close()
