"""A captured graph's static inputs: staged once at capture, refilled before every replay.

A graph reads its inputs from fixed addresses, so each replay first copies the step's inputs into them. The
runner packs a step's small inputs (slots, tokens, positions; MTP's draft rows and pending tokens) into one
tensor so that one host-to-device copy moves them all, and hands the graph views of it. Inputs that are views of
one tensor are staged as views of one static tensor with the same layout (a `Pack`), and a replay whose inputs
share that layout refills the pack with one device copy instead of one copy per view: each copy is a kernel
launch and tens of microseconds of host time, on a decode step of about a millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

_View = tuple[str, tuple[int, ...], tuple[int, ...], int]  # name, shape, stride, storage offset


def _storage_elements(value: torch.Tensor) -> int:
    return value.untyped_storage().nbytes() // value.element_size()


def _whole(value: torch.Tensor, elements: int) -> torch.Tensor:
    """The whole storage behind `value`, flat. (Under inference mode a view has no `_base`: the storage says
    which inputs are views of one tensor.)"""
    return value.as_strided((elements,), (1,), 0)


@dataclass(frozen=True)
class Pack:
    """Inputs that were views of one tensor at capture: their static copies are views of `base` (flat)."""

    base: torch.Tensor
    views: tuple[_View, ...]

    def source(self, inputs: Mapping[str, Any]) -> torch.Tensor | None:
        """The tensor the inputs are views of (flat), when they are laid out in it as at capture; else None.
        (Pointer arithmetic, not a storage object per input: this runs before every replay.)"""
        first = inputs.get(self.views[0][0])
        dtype = self.base.dtype
        if not isinstance(first, torch.Tensor) or first.dtype is not dtype:
            return None
        size = first.element_size()
        start = first.data_ptr() - first.storage_offset() * size
        for name, shape, stride, offset in self.views:
            value = inputs[name]
            if (value.data_ptr() != start + offset * size or value.shape != shape or value.stride() != stride
                    or value.dtype is not dtype):
                return None
        if first.untyped_storage().nbytes() != self.base.numel() * size:
            return None
        return _whole(first, self.base.numel())


def stage_inputs(inputs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[Pack]]:
    """Static copies of the tensor inputs (the graph reads these addresses), the non-tensor inputs, and the
    packs: views of one tensor become views of one static copy of it."""
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    by_storage: dict[tuple, list[str]] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            by_storage.setdefault((value.untyped_storage().data_ptr(), value.device, value.dtype), []).append(name)
        elif hasattr(value, "data_ptr") and hasattr(value, "clone"):
            tensors[name] = value.detach().clone()
        else:
            scalars[name] = value
    packs: list[Pack] = []
    for names in by_storage.values():
        first = inputs[names[0]]
        elements = _storage_elements(first)
        # a pack only where its views cover the tensor (the runner's packed inputs), never a view of a larger one
        # (a slice of another graph's output): its static copy would hold the whole tensor
        if len(names) < 2 or elements > sum(inputs[name].numel() for name in names):
            tensors.update((name, inputs[name].detach().clone()) for name in names)
            continue
        static = _whole(first, elements).detach().clone()
        views = tuple((name, tuple(inputs[name].shape), inputs[name].stride(), inputs[name].storage_offset())
                      for name in names)
        for name, shape, stride, offset in views:
            tensors[name] = static.as_strided(shape, stride, offset)
        packs.append(Pack(static, views))
    return tensors, scalars, packs


def fill_inputs(what: str, tensors: Mapping[str, Any], scalars: Mapping[str, Any], packs: list[Pack],
                inputs: Mapping[str, Any]) -> None:
    """Copy a replay's inputs into the static ones (`what` names the graph in errors): a pack laid out as at
    capture in one copy, every other tensor in its own; non-tensor inputs must equal the captured ones."""
    expected = set(tensors) | set(scalars)
    if set(inputs) != expected:
        raise ValueError(f"{what}: inputs {sorted(inputs)} differ from the captured {sorted(expected)}")
    filled: set[str] = set()
    for pack in packs:
        source = pack.source(inputs)
        if source is not None:
            if source.data_ptr() != pack.base.data_ptr():
                pack.base.copy_(source)
            filled.update(view[0] for view in pack.views)
    for name, value in inputs.items():
        if name in filled:
            continue
        if name in scalars:
            if value != scalars[name]:
                raise ValueError(f"{what}: non-tensor input {name!r} changed from {scalars[name]!r} to "
                                 f"{value!r}; graphs fix it at capture, so put it in the key")
            continue
        static = tensors[name]
        if tuple(value.shape) != tuple(static.shape) or value.dtype != static.dtype:
            raise ValueError(f"{what}: input {name!r} is {tuple(value.shape)} {value.dtype}, captured as "
                             f"{tuple(static.shape)} {static.dtype}; the key must fix the shapes")
        if value.data_ptr() != static.data_ptr():
            static.copy_(value)
