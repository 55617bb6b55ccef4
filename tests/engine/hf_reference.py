"""Test helper: small random transformers models saved with save_pretrained, the parity reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def hf_model(arch: str, seed: int = 0, **overrides: Any):
    """A random transformers CausalLM of `arch` (qwen3 | llama | qwen2) with non-trivial norms and biases."""
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = {**SMALL, "head_dim": 16, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0: perturb them so a missed one shows
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    return model


def save_hf(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory
