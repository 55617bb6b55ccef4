"""Quantized checkpoints in their published layouts load into the internal layouts and compute what the file
encodes: each projection dequantizes to the weight the format's own formula gives, and the model's logits
match an fp32 model built from those dequantized weights (the reference path, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.model.loader import load_checkpoint
from engine.model.quant.linear import Fp8Linear, IntGroupLinear, QuantLinear
from engine.model.random_checkpoint import write_random_checkpoint
from tests.engine.model import quant_files

# hidden 128 / intermediate 256: whole 128-blocks and several groups of 32 per row
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    write_random_checkpoint(path, mtp_layout="deepseek", **SHAPE)
    return path


def _dequantized_model_logits(src, ref: dict[str, torch.Tensor], tmp_path):
    """Logits of the source checkpoint with every quantized projection replaced by its dequantized weight."""
    tensors = load_file(str(src / "model.safetensors"))
    for prefix, w in ref.items():
        tensors[f"{prefix}.weight"] = w.contiguous()
    deq = tmp_path / "dequantized"
    deq.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (deq / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(deq / "model.safetensors"))
    return _logits(load_checkpoint(deq, dtype="float32", device="cpu"))


def _logits(lm):
    ids = torch.tensor([[3, 17, 99, 250, 7, 42, 300, 11]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return lm.model.logits(lm.model(ids, pos))


WRITERS = {
    "qwen-fp8-block": (lambda s, d: quant_files.write_qwen_fp8(s, d), Fp8Linear),
    "ct-fp8-channel": (lambda s, d: quant_files.write_compressed_tensors(s, d, "fp8-channel"), Fp8Linear),
    "ct-int4-sym": (lambda s, d: quant_files.write_compressed_tensors(s, d, "int4-sym"), IntGroupLinear),
    "ct-int4-asym": (lambda s, d: quant_files.write_compressed_tensors(s, d, "int4-asym"), IntGroupLinear),
    "awq": (lambda s, d: quant_files.write_awq(s, d), IntGroupLinear),
    "gptq-sym": (lambda s, d: quant_files.write_gptq(s, d, sym=True), IntGroupLinear),
    "gptq-asym-act-order": (lambda s, d: quant_files.write_gptq(s, d, sym=False, act_order=True), IntGroupLinear),
}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_a_published_layout_loads_to_the_weights_it_encodes_and_the_same_logits(fmt, source, tmp_path):
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    writer, layer_type = WRITERS[fmt]
    ref = writer(source, tmp_path / fmt)
    lm = load_checkpoint(tmp_path / fmt, dtype="float32", device="cpu")
    layers = {name: m for name, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    # every projection of the main layers and the MTP block, none of the rest (embeddings, head, eh_proj)
    assert len(layers) == len(ref) == 7 * 3, sorted(layers)
    assert all(isinstance(m, layer_type) for m in layers.values())
    q = layers["layers.0.self_attn.q_proj"]
    weight = q.dequantize_unpermuted() if isinstance(q, IntGroupLinear) else q.dequantize()
    torch.testing.assert_close(weight, ref["model.layers.0.self_attn.q_proj"], rtol=1e-3, atol=1e-6)
    assert lm.weight_format != "fp32" and lm.model.weight_format == lm.weight_format
    expected = _dequantized_model_logits(source, ref, tmp_path)
    torch.testing.assert_close(_logits(lm), expected, rtol=1e-3, atol=1e-4)


def test_the_fused_projections_of_a_quantized_model_give_the_same_logits(source, tmp_path):
    quant_files.write_awq(source, tmp_path / "awq")
    lm = load_checkpoint(tmp_path / "awq", dtype="float32", device="cpu")
    before = _logits(lm)
    lm.model.fuse_projections()
    attn = lm.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, IntGroupLinear) and isinstance(lm.model.layers[0].mlp.gate_up_proj,
                                                                     IntGroupLinear)
    torch.testing.assert_close(_logits(lm), before, rtol=1e-5, atol=1e-5)


def test_unsupported_quantization_is_one_error_naming_the_key(source, tmp_path):
    quant_files.write_awq(source, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method='bitsandbytes' is not supported"):
        load_checkpoint(tmp_path / "m", dtype="float32", device="cpu")


def test_a_quantized_tensor_of_the_wrong_shape_names_the_tensor(source, tmp_path):
    quant_files.write_awq(source, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.scales"] = tensors["model.layers.1.mlp.down_proj.scales"][:1].contiguous()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.down_proj.scales has shape \[1, 128\]"):
        load_checkpoint(tmp_path / "m", dtype="float32", device="cpu")
