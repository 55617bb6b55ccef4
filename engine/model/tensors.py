"""TensorSource: the tensors of a safetensors checkpoint (one file or a sharded index), read lazily by name."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TensorSource:
    """Maps checkpoint tensor names to their file and reads them one at a time (no full-file load)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        index_path, single_path = directory / INDEX_FILE, directory / SINGLE_FILE
        if index_path.is_file():
            self._read_index(index_path)
        elif single_path.is_file():
            for name in self._handle(SINGLE_FILE).keys():
                self.file_of[name] = SINGLE_FILE
        else:
            raise CheckpointError(str(directory), f"no {SINGLE_FILE} or {INDEX_FILE}: no weights to load")

    def _read_index(self, index_path: Path) -> None:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(str(index_path), f"not a safetensors index with a weight_map: {exc}") from None
        for name, file_name in weight_map.items():
            if not (self.directory / file_name).is_file():
                raise CheckpointError(str(index_path), f"tensor {name} is mapped to {file_name}, which does not exist")
            self.file_of[name] = file_name

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            path = self.directory / file_name
            try:
                self._handles[file_name] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
                raise CheckpointError(str(path), f"cannot open as safetensors: {exc}") from None
        return self._handles[file_name]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def path_of(self, name: str) -> str:
        """The file that holds tensor `name`."""
        return str(self.directory / self.file_of[name])

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the header without loading the data."""
        return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as the safetensors header names it (F32, BF16, I8, F8_E4M3, ...), without the data."""
        return str(self._handle(self.file_of[name]).get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        """The tensor, in its stored dtype, on the CPU."""
        return self._handle(self.file_of[name]).get_tensor(name)

    @property
    def where(self) -> str:
        """The file (or index) a missing tensor should have been in, for error messages."""
        index = self.directory / INDEX_FILE
        return str(index if index.is_file() else self.directory / SINGLE_FILE)

    def close(self) -> None:
        """Close every open file."""
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
