"""Qwen3-MoE: config parsing, loading transformers' own checkpoints, and fp32 parity with Qwen3MoeForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import CheckpointError
from engine.model import ModelConfig, load_checkpoint, save_checkpoint
from tests.engine.model.dense_kv import DenseKVCache
from engine.model.moe import SparseMoE, sparse_blocks

TOL = 1e-4
PROMPT_TOKENS = 48
HF_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256)


def _hf_moe(tmp_path, seed: int = 0, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**HF_MOE, **overrides})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # transformers starts norms at 1: perturb them so a misplaced one shows
                param.add_(0.1 * torch.randn_like(param))
            elif "gate" in name and "proj" not in name:
                param.normal_(0.0, 0.5)  # a router with opinions: top-k choices differ token to token
    model.save_pretrained(tmp_path)
    return model


def _prompt(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(PROMPT_TOKENS)[None].expand(batch, -1)


CASES = {
    "plain": {},
    "norm-topk": {"norm_topk_prob": True},
    "sparse-step-2": {"decoder_sparse_step": 2},
    "mlp-only-0": {"mlp_only_layers": [0], "tie_word_embeddings": True},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_qwen3_moe_parity_full_and_incremental(tmp_path, name):
    ref = _hf_moe(tmp_path, **CASES[name])
    raw = json.loads((tmp_path / "config.json").read_text())
    lm = load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)
    ids, positions = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits
        full = lm.model.logits(lm.model(ids, positions))
        kv = DenseKVCache.for_config(lm.config, 2, PROMPT_TOKENS)
        hidden = [lm.model(ids[:, :11], positions[:, :11], kv)]
        for t in range(11, PROMPT_TOKENS):
            hidden.append(lm.model(ids[:, t:t + 1], positions[:, t:t + 1], kv))
        incremental = lm.model.logits(torch.cat(hidden, 1))
    sparse = [type(layer.mlp) is SparseMoE for layer in lm.model.layers]
    expected_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref.model.layers]
    assert sparse == expected_sparse and any(sparse)
    assert lm.config.moe.num_experts == raw.get("num_experts", raw.get("num_local_experts")) == 8
    assert (full - expected).abs().max().item() <= TOL
    assert (incremental - expected).abs().max().item() <= TOL


def test_moe_routing_is_used_not_averaged(tmp_path):
    # The same weights with another expert's down projection zeroed must change the logits: the test above
    # would not see a router that ignored its choices if every expert were alike.
    _hf_moe(tmp_path)
    lm = load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)
    ids, positions = _prompt(1)
    with torch.no_grad():
        before = lm.model.logits(lm.model(ids, positions))
        block = sparse_blocks(lm.model)[0]
        weights, routed = block.route(torch.randn(64, 64))
        assert len(set(routed.flatten().tolist())) > 2
        for expert in block.experts:
            expert.down_proj.weight.mul_(torch.rand(()) + 0.5)
        after = lm.model.logits(lm.model(ids, positions))
    assert (after - before).abs().max().item() > 1e-3


def test_moe_config_errors_name_the_key(tmp_path):
    base = {"model_type": "qwen3_moe", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8}
    assert ModelConfig.from_hf(base).moe.num_experts == 4
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "moe_intermediate_size"})
    with pytest.raises(CheckpointError, match="num_experts_per_tok=8 exceeds num_experts=4"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 8})
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        ModelConfig.from_hf({**base, "mlp_only_layers": "0"})


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_moe(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_checkpoint(tmp_path, dtype="float32", device="cpu", tokenizer=False)


def test_random_moe_checkpoint_with_mtp_round_trips(make_checkpoint, tmp_path):
    path = make_checkpoint(size="moe-tiny", mtp_layout="deepseek")
    lm = load_checkpoint(path, dtype="float32", device="cpu")
    assert type(lm.model.mtp.layers[0].block.mlp) is SparseMoE  # DeepSeek-V3 / Qwen3-Next MTP blocks are MoE
    assert [b.moe_index for b in sparse_blocks(lm.model)] == [0, 1, 2]
    save_checkpoint(lm.model, tmp_path / "copy", lm.eos_token_ids)
    again = load_checkpoint(tmp_path / "copy", dtype="float32", device="cpu", tokenizer=False)
    ids, positions = _prompt(1)
    ids = ids % 500
    with torch.no_grad():
        assert torch.equal(lm.model(ids, positions), again.model(ids, positions))


def test_routes_by_expert_are_torch_where_s_per_expert_with_padding_rows_left_out():
    from engine.model.moe import routes_by_expert

    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(16, generator=gen)[:3] for _ in range(37)])  # [37, 3], top-k: distinct
    rows = torch.rand(37, generator=gen) > 0.3
    for mask in (None, rows):
        routes = routes_by_expert(ids, mask)
        real = ids if mask is None else ids[mask]
        assert list(routes) == sorted(set(real.flatten().tolist()))
        for e, (token_idx, pos) in routes.items():
            hit = ids == e if mask is None else (ids == e) & mask[:, None]
            want_t, want_p = torch.where(hit)
            assert torch.equal(token_idx, want_t) and torch.equal(pos, want_p)
    assert routes_by_expert(ids, torch.zeros(37, dtype=torch.bool)) == {}
