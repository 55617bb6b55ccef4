"""The architecture of strata-tiny and its initialisation: a small Qwen3 with one DeepSeek-style MTP layer."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from engine.model.config import MTPConfig, ModelConfig, RopeConfig
from engine.model.causal_lm import CausalLM

# Served contexts may be this long; training windows are far shorter and RoPE carries the rest.
SERVED_CONTEXT_TOKENS = 262144


@dataclass
class ArchSettings:
    """The sizes of the model; defaults give about 17.6M parameters (35 MB in bf16)."""

    hidden_size: int = 384
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rope_theta: float = 1_000_000.0
    mtp_layers: int = 1
    init_std: float = 0.02

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def model_config(arch: ArchSettings, vocab_size: int) -> ModelConfig:
    """The ModelConfig the loader will read back from config.json."""
    return ModelConfig(
        arch="qwen3",
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=SERVED_CONTEXT_TOKENS,
        tie_word_embeddings=True,
        qk_norm=True,
        rope=RopeConfig(theta=arch.rope_theta),
        mtp=MTPConfig(num_layers=arch.mtp_layers, layout="deepseek") if arch.mtp_layers else None,
        torch_dtype="bfloat16",
    )


def init_weights(model: CausalLM, std: float) -> None:
    """GPT-2 style: N(0, std) everywhere, residual output projections scaled by 1/sqrt(2 * blocks), norms at 1.

    torch's defaults (N(0, 1) embeddings) would give a tied head logits in the hundreds at step 0.
    """
    blocks = model.config.num_hidden_layers + model.mtp_depth_layers
    residual_std = std / math.sqrt(2 * blocks)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            is_residual_out = name.endswith("o_proj") or name.endswith("down_proj")
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual_out else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)


def build_model(arch: ArchSettings, vocab_size: int, seed: int, device: torch.device) -> CausalLM:
    """A freshly initialised CausalLM (fp32 master weights) on `device`, identical for the same seed."""
    torch.manual_seed(seed)
    model = CausalLM(model_config(arch, vocab_size))
    init_weights(model, arch.init_std)
    return model.to(device)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied head and the MTP's shared embedding count once)."""
    return sum(p.numel() for p in model.parameters())
