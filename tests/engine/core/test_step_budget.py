"""The default step token budget (engine.core.step_budget): sized by the device's measured matmul rate and the
model's work per prompt token, within its bounds, and the option still sets it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.step_budget import (BUDGET_GRANULE_TOKENS, MAX_STEP_TOKEN_BUDGET, MIN_STEP_TOKEN_BUDGET,
                                     TARGET_PREFILL_STEP_S, default_step_token_budget, estimated_prefill_tok_s,
                                     prefill_flops_per_token)
from engine.model.causal_lm import CausalLM
from engine.model.random_checkpoint import random_config


def _linear_weights_per_token(size: str) -> float:
    """The oracle: the model's own parameters a prompt token multiplies by (every decoder layer's 2-D weights;
    a routed layer's experts counted top_k / num_experts each), the embedding and the vocabulary head left out."""
    config = random_config(size=size)
    with torch.device("meta"):
        model = CausalLM(config)
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or not name.startswith("layers."):
            continue
        share = config.moe.num_experts_per_tok / config.moe.num_experts if ".experts." in name else 1.0
        total += p.numel() * share
    return total


@pytest.mark.parametrize("size", ["tiny", "0.6b", "moe-tiny", "moe-small"])
def test_the_work_per_token_is_the_weights_a_prompt_token_multiplies_by(size: str) -> None:
    assert prefill_flops_per_token(random_config(size=size)) == pytest.approx(2 * _linear_weights_per_token(size))


def test_the_budget_is_the_tokens_the_device_prefills_in_the_target_time() -> None:
    assert TARGET_PREFILL_STEP_S == 0.05
    # 200K tokens/s x 50 ms = 10,000 tokens: rounded down to a multiple of 1024
    assert default_step_token_budget(200_000.0, 2048) == 9 * BUDGET_GRANULE_TOKENS
    # a slow device or a large model: never below the former fixed default, nor below one chunk
    assert default_step_token_budget(1_000.0, 2048) == MIN_STEP_TOKEN_BUDGET == 4096
    assert default_step_token_budget(1_000.0, 8192) == 8192
    # a fast device and a small model: at most vLLM's largest default
    assert default_step_token_budget(5_000_000.0, 2048) == MAX_STEP_TOKEN_BUDGET == 16384
    rates = [10_000.0 * 2 ** i for i in range(12)]
    budgets = [default_step_token_budget(r, 2048) for r in rates]
    assert budgets == sorted(budgets) and len(set(budgets)) > 2  # it follows the rate between the bounds


def test_an_h200_class_rate_gives_a_small_model_a_larger_budget_than_a_large_one() -> None:
    """What the rule does with the figures of the issue's device (about 700 TFLOP/s measured bf16 matmul)."""
    flop_s = 700e12
    small = default_step_token_budget(estimated_prefill_tok_s(flop_s, prefill_flops_per_token(
        random_config(size="0.6b"))), 2048)
    large = default_step_token_budget(estimated_prefill_tok_s(flop_s, prefill_flops_per_token(
        random_config(size="8b"))), 2048)
    assert small == MAX_STEP_TOKEN_BUDGET and MIN_STEP_TOKEN_BUDGET <= large < small
    with pytest.raises(ValueError, match="matmul_flop_s=0"):
        estimated_prefill_tok_s(0.0, 1.0)


def test_the_config_leaves_the_budget_to_the_device_unless_given() -> None:
    assert EngineConfig().step_token_budget is None
    assert "--step-token-budget" not in EngineConfig().to_argv()
    given = EngineConfig(step_token_budget=1024, prefill_chunk_tokens=512)
    assert given.to_argv()[given.to_argv().index("--step-token-budget") + 1] == "1024"
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        EngineConfig(step_token_budget=1024, prefill_chunk_tokens=2048)


def test_an_engine_started_without_a_budget_gets_the_rule_s(tmp_path: Path) -> None:
    from engine.exec.device_rate import matmul_flop_s
    from tests.engine.engine_helpers import lively_checkpoint, make_engine

    ckpt = lively_checkpoint(tmp_path / "ckpt")
    engine = make_engine(ckpt, step_token_budget=None, prefill_chunk_tokens=64)
    try:
        budget = engine.sched.step_token_budget
        assert MIN_STEP_TOKEN_BUDGET <= budget <= MAX_STEP_TOKEN_BUDGET and budget % BUDGET_GRANULE_TOKENS == 0
    finally:
        engine.close()
    assert matmul_flop_s(torch.device("cpu"), torch.float32) > 1e6
    engine = make_engine(ckpt, step_token_budget=256, prefill_chunk_tokens=64)
    try:
        assert engine.sched.step_token_budget == 256
    finally:
        engine.close()
