"""Loader: the HF layout (single file, sharded index), dtypes, builtin:NAME, and errors naming file or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError, ConfigError
from engine.model import load_checkpoint, resolve_model_path, save_checkpoint
from engine.model import loader as loader_module
from engine.model.config import ModelConfig


def _copy(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _logits(lm, tokens: int = 8) -> torch.Tensor:
    ids = torch.arange(tokens)[None] % lm.config.vocab_size
    with torch.no_grad():
        return lm.model.logits(lm.model(ids, torch.arange(tokens)[None])).float()


def test_loads_tiny_with_tokenizer_and_eos(tiny_checkpoint):
    lm = load_checkpoint(tiny_checkpoint, dtype="auto", device="cpu")
    assert lm.dtype == torch.float32 and lm.device.type == "cpu"
    assert lm.tokenizer.decode(lm.tokenizer.encode("Hello, world!")) == "Hello, world!"
    im_end = lm.tokenizer.token_to_id("<|im_end|>")
    assert im_end in lm.eos_token_ids and lm.tokenizer.eos_token_id == im_end
    assert not any(p.requires_grad for p in lm.model.parameters()) and not lm.model.training


def test_sharded_index_loads_same_logits(tiny_checkpoint, tmp_path):
    lm = load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu")
    save_checkpoint(lm.model, tmp_path, lm.eos_token_ids, shard_mib=0)  # 0 MiB: one tensor per shard
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    sharded = load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)
    assert torch.equal(_logits(lm), _logits(sharded))


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_load_close_to_fp32(tiny_checkpoint, dtype, torch_dtype):
    ref = _logits(load_checkpoint(tiny_checkpoint, dtype="float32", device="cpu", tokenizer=False))
    lm = load_checkpoint(tiny_checkpoint, dtype=dtype, device="cpu", tokenizer=False)
    assert all(p.dtype == torch_dtype for p in lm.model.parameters())
    # tiny random model: logits are O(0.1); bf16 keeps ~3 significant digits through two layers
    assert (_logits(lm) - ref).abs().max().item() < 2e-2


def test_builtin_resolves_to_package_dir(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(loader_module, "MODELS_DIR", tmp_path)
    with pytest.raises(CheckpointError, match="embedded model is not installed"):
        resolve_model_path("builtin:strata-tiny")
    _copy(tiny_checkpoint, tmp_path / "strata-tiny")
    assert resolve_model_path("builtin:strata-tiny") == tmp_path / "strata-tiny"
    assert load_checkpoint("builtin:strata-tiny", device="cpu").config.arch == "qwen3"


def test_not_a_checkpoint_names_the_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json") as info:
        load_checkpoint(tmp_path, device="cpu")
    assert info.value.path == str(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "nope", device="cpu")


def test_no_weights_names_the_files(tiny_checkpoint, tmp_path):
    _copy(tiny_checkpoint, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(tmp_path, device="cpu")


def test_shape_mismatch_names_tensor_and_file(tiny_checkpoint, tmp_path):
    _copy(tiny_checkpoint, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.mlp\.down_proj\.weight has shape \[64, 100\], "
                                              r"expected \[64, 128\]") as info:
        load_checkpoint(tmp_path, device="cpu")
    assert info.value.path.endswith("model.safetensors")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'gpt2'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling type 'longrope' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_size": None}, "missing required key 'hidden_size'"),
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
    ],
)
def test_config_refusals_name_the_key(tiny_checkpoint, tmp_path, change, message):
    _copy(tiny_checkpoint, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path, device="cpu")
    assert info.value.path.endswith("config.json")


def test_config_reads_both_rope_formats():
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 3.0}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 3.0}})
    assert old.rope == new.rope and old.rope.type == "linear" and old.rope.factor == 3.0 and old.rope.theta == 5e5
    assert old.num_key_value_heads == 2 and old.head_dim == 4 and not old.qk_norm
    assert ModelConfig.from_hf({**base, "model_type": "qwen2"}).attention_bias


def test_bad_device_and_dtype_are_config_errors(tiny_checkpoint):
    with pytest.raises(ConfigError, match="dtype"):
        load_checkpoint(tiny_checkpoint, dtype="int4", device="cpu")
    with pytest.raises(ConfigError, match="device"):
        load_checkpoint(tiny_checkpoint, device="tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            load_checkpoint(tiny_checkpoint, device="cuda:0")
