"""A graph's packed inputs (engine.exec.graphs.inputs): views of one staged tensor are refilled with one copy, and a
replay still reads exactly its own inputs whatever their layout. CPU graph backend, as the runner packs them, and
under inference mode as the engine runs its steps (where a view keeps no `_base`)."""

from __future__ import annotations

import pytest
import torch

from engine.exec.graphs.backends import CpuGraphBackend
from engine.exec.graphs.inputs import fill_inputs, stage_inputs
from engine.exec.graphs.cache import GraphCache
from engine.switches import SwitchBoard
from engine.telemetry import EventBus


def _cache() -> GraphCache:
    return GraphCache("cpu", EventBus(), SwitchBoard.from_values({}), lambda mib, reason: 0.0,
                      backend=CpuGraphBackend(None), wait_interval_s=0.0, sleep=lambda s: None)


def _verify_like(packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ModelRunner.verify_inputs hands a graph: columns of one [rows, 3 + T] tensor."""
    return {"slots": packed[:, 0], "draft_rows": packed[:, 1], "pending": packed[:, 2:3], "positions": packed[:, 3:]}


def _step(ins):
    y = ins["slots"] * 1000 + ins["draft_rows"] * 100 + ins["pending"][:, 0] * 10 + ins["positions"].sum(1)
    return {"y": y.double()}  # not the inputs' dtype: the backend's output copies are told apart from input copies


def _expected(packed: torch.Tensor) -> torch.Tensor:
    return (packed[:, 0] * 1000 + packed[:, 1] * 100 + packed[:, 2] * 10 + packed[:, 3:].sum(1)).double()


@pytest.fixture(params=["plain", "inference"])
def mode(request):
    with torch.inference_mode() if request.param == "inference" else torch.no_grad():
        yield request.param


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_views_of_one_tensor_are_staged_as_views_of_one_static_copy(mode) -> None:
    packed = torch.arange(12).view(2, 6).clone()
    other = torch.ones(3)
    tensors, scalars, packs = stage_inputs({**_verify_like(packed), "span": 64, "other": other})
    assert scalars == {"span": 64} and len(packs) == 1
    (pack,) = packs
    assert _storage(pack.base) != _storage(packed) and torch.equal(pack.base, packed.flatten())
    for name in ("slots", "draft_rows", "pending", "positions"):
        assert _storage(tensors[name]) == _storage(pack.base)  # one static tensor behind the four inputs
        assert torch.equal(tensors[name], _verify_like(packed)[name])
    assert _storage(tensors["other"]) not in (_storage(other), _storage(pack.base))  # a copy of its own


def test_a_view_of_a_larger_tensor_is_not_packed(mode) -> None:
    """A slice of something bigger (another graph's output) must not drag the whole tensor into the graph."""
    big = torch.zeros(1000, 8)
    tensors, _, packs = stage_inputs({"hidden": big[:2], "rows": big[2:3]})
    assert packs == [] and tensors["hidden"].untyped_storage().nbytes() == 2 * 8 * 4


def test_a_packed_replay_refills_with_one_copy_and_reads_its_own_inputs(mode) -> None:
    cache = _cache()
    first = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    cache.run("verify", "k", _step, _verify_like(first))
    entry = next(iter(cache._entries.values()))
    copies: list[torch.Tensor] = []
    original = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        copies.append(src)
        return original(self, src, *args, **kwargs)

    for seed in range(3):
        packed = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(seed))
        torch.Tensor.copy_ = counting_copy
        try:
            out = cache.run("verify", "k", _step, _verify_like(packed))
        finally:
            torch.Tensor.copy_ = original
        assert torch.equal(out["y"], _expected(packed))
    # one copy a replay, of the whole packed tensor, and none of its four views one by one; the pack's static
    # tensor holds the last replay's inputs
    assert [tuple(c.shape) for c in copies if c.dtype == torch.long] == [(12,)] * 3
    assert torch.equal(entry.packs[0].base, packed.flatten())


def test_inputs_laid_out_otherwise_are_refilled_one_by_one(mode) -> None:
    cache = _cache()
    cache.run("verify", "k", _step, _verify_like(torch.arange(12).view(2, 6).clone()))
    # separate tensors, and views of another layout (positions first): the same values reach the graph
    packed = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    separate = {name: value.clone() for name, value in _verify_like(packed).items()}
    assert torch.equal(cache.run("verify", "k", _step, separate)["y"], _expected(packed))
    other = torch.cat([packed[:, 3:], packed[:, :3]], dim=1)
    moved = {"positions": other[:, :3], "slots": other[:, 3], "draft_rows": other[:, 4], "pending": other[:, 5:6]}
    assert torch.equal(cache.run("verify", "k", _step, moved)["y"], _expected(packed))
    # the same layout at the start of a larger tensor: its views are refilled one by one, not the whole of it
    larger = torch.zeros(4, 6, dtype=torch.long)
    larger[:2] = packed
    assert torch.equal(cache.run("verify", "k", _step, _verify_like(larger[:2]))["y"], _expected(packed))


def test_a_packed_input_of_another_shape_is_named_in_the_error() -> None:
    tensors, scalars, packs = stage_inputs(_verify_like(torch.arange(12).view(2, 6).clone()))
    wider = _verify_like(torch.arange(14).view(2, 7).clone())
    with pytest.raises(ValueError, match=r"verify graph \(b2\): input 'positions' is \(2, 4\).*captured as \(2, 3\)"):
        fill_inputs("verify graph (b2)", tensors, scalars, packs, wider)
    with pytest.raises(ValueError, match="differ from the captured"):
        fill_inputs("verify graph (b2)", tensors, scalars, packs, {"slots": torch.zeros(2, dtype=torch.long)})
