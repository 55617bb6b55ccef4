"""The quantized kernels' committed launch table: per device and class of weight, the launch shape of each path
and the row counts where one path hands over to the next. Read once; never tuned at run time (a launch shape is
a function of the weight, so a captured CUDA graph stays valid and a start costs no search).

    entry = lookup("NVIDIA H200", "int4", 4096, 12288)   # {} where the table has none: the defaults apply

launch_table.json beside this file: {"devices": {DEVICE NAME: {CLASS: ENTRY}}}, CLASS `FORMAT/nN/kK` with N and K
rounded up to powers of two (the 8B shape's gate/up, 24576 x 4096, is `int4/n32768/k4096`), FORMAT one of
`fp8` (a scale per channel), `fp8-block` (blocks along K), `int4`, `int8` (groups of 128 and up, or one group),
`int4-g32`, `int8-g32`, `int8-g16` (GGUF's smaller groups). ENTRY's keys, each optional:
- `gemv`, `tc`: launch shapes `BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES` of the 1-4 row and the tensor-core paths (`tc`:
  also `...xpairs`, int4 codes unpacked two at a time: engine.model.quant.tensor_core_pairs);
- `gemv_rows` (0 or 4): the most rows the GEMV takes; `tc_rows`: the most the tensor-core kernel takes (more rows:
  the prompt-chunk path, engine.model.quant.dense);
- `tinygemm_rows` (int4; 0, or 4 and up): the most rows torch._weight_int4pack_mm (PyTorch's tinygemm) takes instead
  of these kernels; `backend`: `triton` (these kernels) or `tinygemm` (tinygemm up to `tc_rows`).
A decode step of 1-4 sequences takes one path (engine.model.quant.kernels.DEFAULT_GEMV_ROWS says why), so neither
threshold falls inside 1-3.
`strata-engine bench linear --quant ... --quant-tune ... --table-out FILE` writes a table of this form from the
fastest shape it measured per class and row count.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("launch_table.json")
ENTRY_KEYS = ("gemv", "tc", "gemv_rows", "tc_rows", "tinygemm_rows", "backend")
BACKENDS = ("triton", "tinygemm")
ONE_PATH_ROWS = 4  # the sequences of a decode step that all take one path: the GEMV's most rows


def pow2_at_least(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


def shape_class(fmt: str, n: int, k: int) -> str:
    return f"{fmt}/n{pow2_at_least(n)}/k{pow2_at_least(k)}"


def layer_format(layer) -> str:
    """The table's FORMAT of a quantized layer."""
    if layer.format == "fp8":
        return "fp8" if layer.block_k >= layer.in_features else "fp8-block"
    group = layer.group_size
    return layer.format if group >= 128 or group == layer.in_features else f"{layer.format}-g{group}"


def load() -> dict[str, dict[str, dict[str, Any]]]:
    """The committed table's devices; a table that is not of the form above is a ValueError naming the file and
    key."""
    return read(TABLE_PATH)


@functools.lru_cache(maxsize=4)
def read(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    raw = json.loads(path.read_text())
    devices = raw.get("devices") if isinstance(raw, dict) else None
    if not isinstance(devices, dict):
        raise ValueError(f"{path}: expected {{\"devices\": {{DEVICE: {{CLASS: ENTRY}}}}}}")
    for device, classes in devices.items():
        for cls, entry in classes.items():
            where = f"{path}: devices.{device}.{cls}"
            if not isinstance(entry, dict) or set(entry) - set(ENTRY_KEYS):
                raise ValueError(f"{where}: an entry has only the keys {', '.join(ENTRY_KEYS)}")
            if entry.get("backend", "triton") not in BACKENDS:
                raise ValueError(f"{where}.backend={entry['backend']!r}: expected one of {', '.join(BACKENDS)}")
            if not (int(entry.get("tinygemm_rows", 0)) == 0 or int(entry["tinygemm_rows"]) >= ONE_PATH_ROWS):
                raise ValueError(f"{where}.tinygemm_rows={entry['tinygemm_rows']}: expected 0, or {ONE_PATH_ROWS} rows "
                                 f"and up (a decode step of 1-{ONE_PATH_ROWS} sequences takes one path)")
            if int(entry.get("gemv_rows", 0)) not in (0, ONE_PATH_ROWS):
                raise ValueError(f"{where}.gemv_rows={entry['gemv_rows']}: expected 0 or {ONE_PATH_ROWS} (a decode "
                                 f"step of 1-{ONE_PATH_ROWS} sequences takes one path)")
    return devices


def lookup(device_name: str, fmt: str, n: int, k: int) -> dict[str, Any]:
    return dict(load().get(device_name, {}).get(shape_class(fmt, n, k), {}))
