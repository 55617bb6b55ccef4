"""Broken checkpoints, written by these tests from good ones, are refused at load with one error naming the file
and the key or tensor at fault: numbers a config cannot mean (NaN, infinity, a trillion layers), quantized
tensors of the wrong shape or dtype, and GGUF files whose header lies or whose data is cut short. Never a
numpy or torch message naming no tensor, never a hang, never a server that says ready and answers 500."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.model.loader import MODELS_DIR, load_checkpoint
from engine.model.random_checkpoint import write_random_checkpoint
from tests.engine.model import quant_files

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 90  # a refused load takes seconds; a hang is what these tests catch
# hidden 128 / intermediate 256: whole 128-blocks and several groups of 32 per row
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
NUMPY_WORDS = ("out of bounds for axis", "cannot reshape", "must match the size of tensor")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "ckpt"
    write_random_checkpoint(path, **SHAPE)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))  # NaN / Infinity as Python's json writes them


def _edit_tensors(path: Path, **changes: torch.Tensor) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({k.replace("__", "."): v for k, v in changes.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, dtype="float32", device="cpu")
    text = str(err.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, (needle, text)
    assert not any(word in text for word in NUMPY_WORDS), text
    return text


def _cli(*argv: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "engine.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"strata-engine {' '.join(argv)} hung for {TIMEOUT_S} s (stderr: "
                             f"{exc.stderr!r:.300})") from None


@pytest.mark.parametrize(("key", "value"), [("rms_norm_eps", float("nan")), ("rope_theta", float("inf")),
                                            ("rms_norm_eps", -1e-6), ("rope_theta", 0.0)])
def test_a_config_number_that_cannot_work_is_refused_naming_the_key(source, tmp_path, key, value) -> None:
    path = _copy(source, tmp_path / "m")
    _edit_config(path, **{key: value})
    _refused(path, "config.json", key)


def test_a_trillion_layers_is_refused_at_once_not_built(source, tmp_path) -> None:
    path = _copy(source, tmp_path / "m")
    _edit_config(path, num_hidden_layers=1_000_000_000_000)
    done = _cli("generate", "--model", str(path), "--device", "cpu", "--prompt", "hi")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-600:]
    assert "num_hidden_layers" in lines[0] and "config.json" in lines[0]


def test_more_layers_than_the_tensors_hold_is_refused_naming_both(source, tmp_path) -> None:
    path = _copy(source, tmp_path / "m")
    _edit_config(path, num_hidden_layers=40)
    _refused(path, "num_hidden_layers=40", "2 layers")


def test_an_int8_projection_in_an_unquantized_checkpoint_is_refused(source, tmp_path) -> None:
    path = _copy(source, tmp_path / "m")
    q = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    _edit_tensors(path, model__layers__0__self_attn__q_proj__weight=torch.zeros_like(q, dtype=torch.int8))
    _refused(path, "model.layers.0.self_attn.q_proj.weight", "int8", "model.safetensors")


def test_an_fp8_scale_of_the_wrong_axis_is_refused(source, tmp_path) -> None:
    quant_files.write_compressed_tensors(source, tmp_path / "m", "fp8-channel")
    name = "model.layers.0.mlp.down_proj.weight_scale"
    scale = load_file(str(tmp_path / "m" / "model.safetensors"))[name]  # [N, 1]
    _edit_tensors(tmp_path / "m", **{name.replace(".", "__"): scale.reshape(1, -1)})
    _refused(tmp_path / "m", name, f"[1, {scale.shape[0]}]", "model.safetensors")


def test_an_int4_weight_shape_that_lies_is_refused(source, tmp_path) -> None:
    quant_files.write_compressed_tensors(source, tmp_path / "m", "int4-asym")
    name = "model.layers.1.self_attn.o_proj.weight_shape"
    assert name in load_file(str(tmp_path / "m" / "model.safetensors"))
    _edit_tensors(tmp_path / "m", **{name.replace(".", "__"): torch.tensor([999, 999], dtype=torch.int32)})
    _refused(tmp_path / "m", name, "999")


def test_an_int4_zero_point_of_the_wrong_shape_is_refused_naming_it(source, tmp_path) -> None:
    quant_files.write_compressed_tensors(source, tmp_path / "m", "int4-asym")
    name = "model.layers.0.mlp.up_proj.weight_zero_point"
    _edit_tensors(tmp_path / "m", **{name.replace(".", "__"): torch.zeros(47, 3, dtype=torch.int32)})
    _refused(tmp_path / "m", name, "[47, 3]")


# --- GGUF ------------------------------------------------------------------------------------------------------

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from gguf import GGMLQuantizationType as T

    from tests.engine.model.gguf_files import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(MODELS_DIR / "strata-tiny", path, lambda name, shape: T.Q8_0 if "ffn" in name else T.F16)
    return path


def _patched(src: Path, dst: Path, offset: int, value: int) -> Path:
    data = bytearray(src.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", value)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(("offset", "value", "words"), [
    (8, 91, "tensor"), (8, 1 << 62, "tensor"), (16, 1 << 40, "key"),
])
def test_a_gguf_header_that_lies_about_its_counts_is_refused_saying_so(tiny_gguf, tmp_path, offset, value,
                                                                        words) -> None:
    path = _patched(tiny_gguf, tmp_path / "lies.gguf", offset, value)
    text = _refused(path, str(path), str(value))
    assert words in text


def test_a_gguf_file_of_its_magic_alone_is_refused_saying_it_ends(tmp_path) -> None:
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGUF")
    _refused(path, str(path), "ends")


def test_a_gguf_file_cut_in_half_is_refused_naming_a_tensor_past_its_end(tiny_gguf, tmp_path) -> None:
    path = tmp_path / "half.gguf"
    data = tiny_gguf.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    text = _refused(path, str(path), "tensor ")
    assert "ends" in text or "cut" in text


# --- serve: before the port is bound -------------------------------------------------------------------------

def test_serve_with_a_bad_checkpoint_is_one_line_exit_2_before_binding(source, tmp_path) -> None:
    """The port is taken: a start that loaded after binding would say "cannot bind"; the checkpoint's error
    comes first, alone (no uvicorn lines), and the process ends with 2."""
    import socket

    path = _copy(source, tmp_path / "m")
    _edit_config(path, rope_theta=float("nan"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        done = _cli("serve", "--model", str(path), "--device", "cpu", "--port", str(taken.getsockname()[1]))
    finally:
        taken.close()
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-800:]
    assert len(lines) == 1, done.stderr
    assert "rope_theta" in lines[0] and "config.json" in lines[0] and "bind" not in lines[0]
