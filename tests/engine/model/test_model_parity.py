"""Parity with transformers on random-weight checkpoints written by save_pretrained (fp32, 64-token prompts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.model import CausalLM, RopeConfig, load_checkpoint
from tests.engine.model.dense_kv import DenseKVCache

PROMPT_TOKENS = 64
TOL = 1e-4  # fp32 with the same op order: we measure ~1e-7; 1e-4 leaves room for BLAS differences


def _prompt(batch: int = 2, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(7))
    return ids, torch.arange(PROMPT_TOKENS)[None].expand(batch, -1)


def _load(hf_model, tmp_path, arch: str, **overrides):
    ref = hf_model(arch, **overrides)
    ref.save_pretrained(tmp_path)
    return ref, load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)


def _incremental_logits(model: CausalLM, config, ids: torch.Tensor, positions: torch.Tensor, prefill_tokens: int):
    kv = DenseKVCache.for_config(config, ids.shape[0], PROMPT_TOKENS)
    hidden = [model(ids[:, :prefill_tokens], positions[:, :prefill_tokens], kv)]
    for t in range(prefill_tokens, ids.shape[1]):
        hidden.append(model(ids[:, t : t + 1], positions[:, t : t + 1], kv))
    return model.logits(torch.cat(hidden, dim=1))


ARCH_CASES = [
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),
]


@pytest.mark.parametrize("arch,overrides", ARCH_CASES, ids=["qwen3", "qwen3-tied", "llama", "llama-bias", "qwen2"])
def test_parity_full_forward_and_incremental_decode(hf_model, tmp_path, arch, overrides):
    ref, lm = _load(hf_model, tmp_path, arch, **overrides)
    ids, positions = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits
        full = lm.model.logits(lm.model(ids, positions))
        incremental = _incremental_logits(lm.model, lm.config, ids, positions, prefill_tokens=17)
    assert lm.config.arch == arch
    assert (full - expected).abs().max().item() <= TOL
    assert (incremental - expected).abs().max().item() <= TOL


ROPE_CASES = {
    "linear": ("qwen3", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama3": ("llama", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn": ("qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_parity_rope_scaling(hf_model, tmp_path, name):
    arch, rope = ROPE_CASES[name]
    ref, lm = _load(hf_model, tmp_path, arch, rope_parameters=rope)
    ids, positions = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits
        full = lm.model.logits(lm.model(ids, positions))
        incremental = _incremental_logits(lm.model, lm.config, ids, positions, prefill_tokens=9)
        # the same weights with plain RoPE must differ, or this test would not see a broken scaling
        plain = CausalLM(replace(lm.config, rope=RopeConfig(theta=lm.config.rope.theta)))
        plain.load_state_dict(lm.model.state_dict())
        unscaled = plain.logits(plain(ids, positions))
    assert lm.config.rope.type == name
    assert (full - expected).abs().max().item() <= TOL
    assert (incremental - expected).abs().max().item() <= TOL
    assert (unscaled - expected).abs().max().item() > 1e-3


def test_parity_dynamic_rope_full_forward(hf_model, tmp_path):
    # Dynamic NTK rescales by the longest position seen, so only the full forward is comparable
    # (transformers' own incremental decode drifts from its full forward the same way).
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ref, lm = _load(hf_model, tmp_path, "qwen3", rope_parameters=rope, max_position_embeddings=32)
    ids, positions = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits
        full = lm.model.logits(lm.model(ids, positions))
    assert (full - expected).abs().max().item() <= TOL


def test_parity_fused_projections_same_logits(hf_model, tmp_path):
    _, lm = _load(hf_model, tmp_path, "qwen2")  # qwen2: the fused path must carry the q/k/v biases too
    ids, positions = _prompt()
    with torch.no_grad():
        before = lm.model.logits(lm.model(ids, positions))
        lm.model.fuse_projections()
        after = lm.model.logits(lm.model(ids, positions))
        incremental = _incremental_logits(lm.model, lm.config, ids, positions, prefill_tokens=30)
    assert lm.model.layers[0].self_attn.qkv_proj is not None
    assert not hasattr(lm.model.layers[0].self_attn, "q_proj")
    assert (after - before).abs().max().item() <= TOL
    assert (incremental - before).abs().max().item() <= TOL
