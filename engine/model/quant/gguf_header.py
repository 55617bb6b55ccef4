"""The structure of a GGUF file checked before the `gguf` package reads it, so that a damaged file is refused
in words about the file (where it ends, what its header claims), not in numpy's.

`gguf.GGUFReader` trusts the header: a tensor count of 2^62 or a key count of 2^40 runs it off the end of the
file ("index 0 is out of bounds for axis 0 with size 0"), a file cut short fails in a reshape of whichever
tensor it cut, and a count smaller than the file's reads as fewer tensors, each one's data shifted. The walk
here follows llama.cpp's layout (docs: ggml/docs/gguf.md) over the header only: magic, version, counts, each
key and value, each tensor's name, dims, type and offset; then every tensor's data must lie inside the file,
and together they must reach its end.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from engine.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
HEAD_BYTES = 24  # magic, version, tensor count, key-value count
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # a one-byte name, one dim, its type and offset
MIN_KV_BYTES = 8 + 1 + 4 + 1  # a one-byte key, its type, a one-byte value
DEFAULT_ALIGNMENT = 32
# GGUFValueType -> the bytes of one scalar (8 STRING and 9 ARRAY have their own lengths)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Walk:
    """A cursor over the mapped file; every read past the end is a CheckpointError saying where."""

    def __init__(self, data: mmap.mmap | bytes, where: str) -> None:
        self.data = data
        self.size = len(data)
        self.where = where
        self.at = 0

    def take(self, count: int, what: str) -> int:
        start = self.at
        if count < 0 or start + count > self.size:
            raise CheckpointError(self.where, f"the file ends inside {what} (byte {start} of {self.size}; it needs "
                                              f"{count} more): it is cut short or not a GGUF file")
        self.at = start + count
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        length = self.u64(what)
        start = self.take(length, what)
        return bytes(self.data[start:start + length])


def check_gguf_structure(path: Path) -> None:
    """CheckpointError naming the file and what is wrong with its structure, or None when the header and the
    tensor data it describes fit the file."""
    where = str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            raise CheckpointError(where, "the file is empty: not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _check(_Walk(data, where), size)


def _check(walk: _Walk, size: int) -> None:
    where = walk.where
    if bytes(walk.data[:4]) != MAGIC[:min(4, size)] or size < 4:
        raise CheckpointError(where, "no GGUF magic at its start: not a GGUF file")
    walk.take(4, "the magic")
    version = walk.u32("the header's version")
    if version not in VERSIONS:
        raise CheckpointError(where, f"GGUF version {version} (Strata reads versions {', '.join(map(str, VERSIONS))})")
    tensor_count = walk.u64("the header's tensor count")
    kv_count = walk.u64("the header's key-value count")
    room = size - HEAD_BYTES
    if kv_count > room // MIN_KV_BYTES:
        raise CheckpointError(where, f"the header claims {kv_count} key-value pairs; a file of {size} bytes holds at "
                                     f"most {room // MIN_KV_BYTES}: the header is damaged")
    if tensor_count > room // MIN_TENSOR_INFO_BYTES:
        raise CheckpointError(where, f"the header claims {tensor_count} tensors; a file of {size} bytes holds at most "
                                     f"{room // MIN_TENSOR_INFO_BYTES}: the header is damaged")
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = walk.string(f"key {i}").decode("utf-8", "replace")
        kind = walk.u32(f"the type of key {key}")
        value = _skip_value(walk, kind, key)
        if key == "general.alignment" and kind == 4 and value:
            alignment = value
    tensors = []
    for i in range(tensor_count):
        label = f"tensor info {i} of {tensor_count}"
        name = walk.string(label).decode("utf-8", "replace")
        dims = walk.u32(f"tensor {name}'s dimension count")
        if not 0 < dims <= 8:
            raise CheckpointError(where, f"{label} ({name!r}) has {dims} dimensions: the header is damaged (the "
                                         f"tensor count, {tensor_count}, may be wrong)")
        shape = [walk.u64(f"tensor {name}'s dimensions") for _ in range(dims)]
        kind = walk.u32(f"tensor {name}'s type")
        offset = walk.u64(f"tensor {name}'s offset")
        tensors.append((name, shape, kind, offset))
    start = -(-walk.at // alignment) * alignment
    end = start
    for name, shape, kind, offset in tensors:
        n_bytes = _tensor_bytes(shape, kind, name, where)
        stop = start + offset + n_bytes
        if stop > size:
            raise CheckpointError(where, f"tensor {name}'s data runs to byte {stop}, past the file's end at {size}: "
                                         f"the file is cut short")
        end = max(end, stop)
    if size - end >= alignment and tensors:
        raise CheckpointError(where, f"the header lists {tensor_count} tensors, whose data ends at byte {end}, but the "
                                     f"file has {size - end} bytes more: its tensor count is wrong or it is damaged")


def _skip_value(walk: _Walk, kind: int, key: str) -> int | None:
    """Step over one value; returns a UINT32's value (general.alignment is read from it)."""
    if kind == _STRING:
        walk.string(f"the value of {key}")
        return None
    if kind == _ARRAY:
        item = walk.u32(f"the item type of {key}")
        count = walk.u64(f"the length of {key}")
        if item == _STRING:
            for j in range(count):
                walk.take(walk.u64(f"item {j} of {key}"), f"item {j} of {key}")
        elif item in _SCALAR_BYTES:
            walk.take(count * _SCALAR_BYTES[item], f"the {count} items of {key}")
        else:
            raise CheckpointError(walk.where, f"key {key} is an array of unknown type {item}: the header is damaged")
        return None
    if kind not in _SCALAR_BYTES:
        raise CheckpointError(walk.where, f"key {key} has unknown type {kind}: the header is damaged")
    start = walk.take(_SCALAR_BYTES[kind], f"the value of {key}")
    return struct.unpack_from("<I", walk.data, start)[0] if kind == 4 else None


def _tensor_bytes(shape: list[int], kind: int, name: str, where: str) -> int:
    import gguf

    try:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise CheckpointError(where, f"tensor {name} has unknown type id {kind}: the header is damaged") from None
    elements = 1
    for dim in shape:
        elements *= dim
    if shape[0] % block:
        raise CheckpointError(where, f"tensor {name} has rows of {shape[0]} values, not whole blocks of {block}")
    return elements // block * type_bytes
