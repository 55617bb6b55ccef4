"""write_random_checkpoint: a complete HF-layout checkpoint with random weights and a working tokenizer.

For tests and benchmarks of everything above the model layer. Tensors are generated one at a time straight
into the target dtype and written shard by shard, so even the 0.6b size (the Qwen3-0.6B shape) is never held
twice in memory.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from engine.model.config import ARCHS, MTP_LAYOUTS, MoEConfig, MTPConfig, ModelConfig, RopeConfig
from engine.model.loader import resolve_dtype
from engine.model.names import hf_name
from engine.model.causal_lm import CausalLM
from engine.model.saver import write_config_files, write_tensors
from engine.model.tokenizer import CHATML_TEMPLATE
from engine.model.toy_tokenizer import SPECIAL_TOKENS, toy_tokenizer_json

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    ),
    "0.6b": dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    # the Qwen3-8B shape (the quantized-decode benchmark: bf16 / fp8 / int4 at batch 1 and 16); 16 GiB in bf16
    "8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    # Qwen3-MoE shapes (model_type qwen3_moe). moe-tiny: tests (16 experts of 48 KiB in fp32, top-2, one dense
    # layer so both MLP kinds load; a 1 MiB expert cache holds 6 of 16 per layer); moe-bench: the expert-cache benchmark, 24 layers x 64 experts (top-8), ~1.1 GiB of experts
    # in bf16, small enough to write and load within a benchmark's time limit.
    "moe-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        moe=MoEConfig(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      mlp_only_layers=(1,)),
    ),
    "moe-small": dict(  # the benchmark's code path in CI: 4 layers x 32 experts, 24 MiB of experts in fp32
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        moe=MoEConfig(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True),
    ),
    "moe-bench": dict(
        vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
        moe=MoEConfig(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True),
    ),
}
_TOKENIZER_VOCAB = 512
_INIT_STD = 0.02  # transformers' initializer_range default


def random_config(arch: str = "qwen3", mtp_layout: str | None = None, size: str = "tiny", **overrides: Any) -> ModelConfig:
    """The ModelConfig write_random_checkpoint uses; `overrides` replace ModelConfig fields."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: expected one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {', '.join(SIZES)}")
    if mtp_layout is not None and mtp_layout not in MTP_LAYOUTS:
        raise ValueError(f"mtp_layout={mtp_layout!r}: expected None or one of {', '.join(MTP_LAYOUTS)}")
    config = ModelConfig(
        arch=arch,
        **SIZES[size],
        max_position_embeddings=40960,
        rope=RopeConfig(theta=1_000_000.0),
        rms_norm_eps=1e-6,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        mtp=MTPConfig(1, mtp_layout) if mtp_layout else None,
    )
    return replace(config, **overrides) if overrides else config


def _random_tensors(config: ModelConfig, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        shapes = [(name, tuple(p.shape)) for name, p in CausalLM(config).named_parameters()]
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            # Norm weights near 1 but not exactly 1, so tests can tell which norm was applied where.
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            tensor = 0.02 * torch.randn(shape, generator=gen)
        else:
            tensor = torch.empty(shape, dtype=dtype).normal_(0.0, _INIT_STD, generator=gen)
        yield hf_name(name, config), tensor.to(dtype)


def write_tokenizer_files(directory: Path, vocab_size: int = _TOKENIZER_VOCAB) -> tuple[int, ...]:
    """tokenizer.json + tokenizer_config.json (ChatML); returns the eos ids (<|im_end|>, <|endoftext|>)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(toy_tokenizer_json(vocab_size))
    endoftext, _, im_end = SPECIAL_TOKENS
    tok_config = {"eos_token": im_end, "pad_token": endoftext, "bos_token": None, "chat_template": CHATML_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return (SPECIAL_TOKENS.index(im_end), SPECIAL_TOKENS.index(endoftext))


def write_random_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    mtp_layout: str | None = None,
    size: str = "tiny",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    shard_mib: int = 1024,
    **overrides: Any,
) -> Path:
    """Write config.json, generation_config.json, tokenizer files and random safetensors weights to `path`."""
    directory = Path(path)
    config = random_config(arch, mtp_layout, size, **overrides)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    config = replace(config, torch_dtype=str(torch_dtype).removeprefix("torch."))
    eos_ids = write_tokenizer_files(directory, min(_TOKENIZER_VOCAB, config.vocab_size))
    write_config_files(directory, config, eos_ids)
    write_tensors(directory, _random_tensors(config, torch_dtype, seed), shard_mib)
    return directory
