"""write_random_checkpoint: every arch and MTP layout loads; the 0.6b shape is Qwen3-0.6B's."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model import CausalLM, load_checkpoint
from engine.model.random_checkpoint import random_config, write_random_checkpoint


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("mtp_layout", [None, "deepseek", "qwen3_next"])
def test_every_variant_loads_and_generates_finite_logits(tmp_path, arch, mtp_layout):
    path = write_random_checkpoint(tmp_path, arch=arch, mtp_layout=mtp_layout, seed=3)
    lm = load_checkpoint(path, device="cpu")
    assert lm.config.arch == arch and (lm.config.mtp is None) == (mtp_layout is None)
    ids = torch.tensor([lm.tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        logits = lm.model.logits(lm.model(ids, torch.arange(ids.shape[1])[None]))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_seed_and_dtype(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", seed=1, dtype="bfloat16")
    b = write_random_checkpoint(tmp_path / "b", seed=1, dtype="bfloat16")
    c = write_random_checkpoint(tmp_path / "c", seed=2, dtype="bfloat16")
    assert json.loads((a / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    lm = load_checkpoint(a, dtype="bfloat16", device="cpu", tokenizer=False)
    assert lm.model.embed_tokens.weight.dtype == torch.bfloat16


def test_0_6b_config_is_the_qwen3_0_6b_shape():
    config = random_config(size="0.6b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (1024, 28, 16)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (8, 128, 3072)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    with torch.device("meta"):
        params = sum(p.numel() for p in CausalLM(config).parameters())
    assert 590e6 < params < 600e6  # Qwen3-0.6B: 596M with the tied embedding counted once


def test_unknown_size_arch_layout_are_refused(tmp_path):
    with pytest.raises(ValueError, match="size='7b'"):
        write_random_checkpoint(tmp_path, size="7b")
    with pytest.raises(ValueError, match="arch='gpt2'"):
        write_random_checkpoint(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="mtp_layout='eagle'"):
        write_random_checkpoint(tmp_path, mtp_layout="eagle")
