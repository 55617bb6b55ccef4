"""Fixtures for engine tests: random-weight checkpoints written by engine.model.random_checkpoint.

`tiny_checkpoint` is a Qwen3 tiny checkpoint with a DeepSeek-layout MTP head and a working tokenizer, written
once per test session; `make_checkpoint(**kwargs)` writes (and caches) any other write_random_checkpoint variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

HF_SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: make_checkpoint(arch="qwen3", mtp_layout=None, size="tiny", dtype="float32", seed=0, **overrides)."""
    from engine.model.random_checkpoint import write_random_checkpoint

    cache: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            cache[key] = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    """A tiny Qwen3 checkpoint (fp32, tied head, 1 DeepSeek MTP layer, toy BPE tokenizer)."""
    return make_checkpoint(arch="qwen3", mtp_layout="deepseek", size="tiny")


def _hf_model(arch: str, seed: int = 0, **overrides: Any):
    import torch
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**HF_SMALL, **overrides})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0: perturb them so a missed one shows
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="session")
def hf_model() -> Callable[..., Any]:
    """Factory: hf_model(arch, seed=0, **config overrides) -> a small random transformers CausalLM (the parity
    reference) with non-trivial norms and biases. Skips the test when transformers is not installed."""
    pytest.importorskip("transformers")
    return _hf_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random checkpoint whose greedy output varies (default random weights repeat one token forever)."""
    from tests.engine.engine_helpers import shared_lively_checkpoint

    return shared_lively_checkpoint(tmp_path_factory)


@pytest.fixture
def one_torch_thread() -> Any:
    """One torch thread: on a shared 2-core box, spinning intra-op threads make tiny engine steps far slower."""
    from tests.engine.engine_helpers import one_thread

    with one_thread():
        yield
