"""The default step token budget: sized to the device and the model, not a fixed number. Pure Python.

`step_token_budget` bounds the tokens one engine step computes (decode tokens first, prompt chunks with the
rest). Too small, and a burst of prompts is admitted a few per step while the device could take them all at
once: first tokens wait for steps the device had room for. Too large, and a step with no decoding slot (where
the prefill pacer does not limit it) takes long enough to hold back the slots that start decoding after it.

The rule: the tokens whose prefill takes about `TARGET_PREFILL_STEP_S` at the model's estimated prefill rate,
rounded down to a multiple of `BUDGET_GRANULE_TOKENS`, within [`MIN_STEP_TOKEN_BUDGET`, `MAX_STEP_TOKEN_BUDGET`]
and never below the chunk size. The rate is estimated from the device's measured matmul rate (engine.exec.
device_rate: one large product timed at start) and the model's multiply-adds per prompt token (every linear
layer a token passes through: attention projections, its MLP or its routed experts' share, not the vocabulary
head, which a prompt chunk runs for its last token only), at `PREFILL_MATMUL_EFFICIENCY` of the matmul rate
(norms, rotations, attention and the launches between the products). Attention over a long prefix is not in
it: the pacer sizes chunks deep into a context by their measured cost. The bounds are vLLM's: its default
`max_num_batched_tokens` is 2,048-16,384 by device class; the lower one here is the fixed default the engine
had, so no device gets a smaller budget than before.

`--step-token-budget N` (EngineConfig.step_token_budget) still sets it; `None` asks for this rule.
"""

from __future__ import annotations

from typing import Any

TARGET_PREFILL_STEP_S = 0.05
PREFILL_MATMUL_EFFICIENCY = 0.5
MIN_STEP_TOKEN_BUDGET = 4096
MAX_STEP_TOKEN_BUDGET = 16384
BUDGET_GRANULE_TOKENS = 1024


def prefill_flops_per_token(config: Any) -> float:
    """Floating-point operations (2 per multiply-add) of one prompt token's linear layers under `config`
    (an engine.model.ModelConfig): q/k/v/o, and per layer the dense MLP or the routed experts it reaches."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)  # q, o; k, v
    dense_mlp = 3 * h * config.intermediate_size  # gate, up, down
    total = 0
    for layer in range(config.num_hidden_layers):
        moe = config.moe
        if moe is not None and moe.is_sparse(layer, config.num_hidden_layers):
            mlp = 3 * h * moe.moe_intermediate_size * moe.num_experts_per_tok + h * moe.num_experts  # + router
        else:
            mlp = dense_mlp
        total += attn + mlp
    return 2.0 * total


def estimated_prefill_tok_s(matmul_flop_s: float, flops_per_token: float) -> float:
    """Prompt tokens a second at `PREFILL_MATMUL_EFFICIENCY` of the device's measured matmul rate."""
    if matmul_flop_s <= 0 or flops_per_token <= 0:
        raise ValueError(f"expected positive rates, got matmul_flop_s={matmul_flop_s}, "
                         f"flops_per_token={flops_per_token}")
    return matmul_flop_s * PREFILL_MATMUL_EFFICIENCY / flops_per_token


def default_step_token_budget(prefill_tok_s: float, prefill_chunk_tokens: int,
                              target_step_s: float = TARGET_PREFILL_STEP_S) -> int:
    """The budget the rule gives for a device that prefills `prefill_tok_s` tokens a second."""
    tokens = int(prefill_tok_s * target_step_s) // BUDGET_GRANULE_TOKENS * BUDGET_GRANULE_TOKENS
    tokens = min(max(tokens, MIN_STEP_TOKEN_BUDGET), MAX_STEP_TOKEN_BUDGET)
    return max(tokens, prefill_chunk_tokens)
