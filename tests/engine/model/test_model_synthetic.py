"""Synthetic sources (engine/model/synthetic.py): `random:NAME` without a file, generated at load from seeds."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.exec.experts.cache import ExpertCache
from engine.model import load_checkpoint
from engine.model.moe import sparse_blocks
from engine.model.synthetic import SPECS, is_synthetic, tensor_seed
from engine.telemetry import EventBus

TINY = "random:moe-synth-tiny"


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    return model.logits(model(ids, positions))


@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint(TINY, device="cpu")


def test_two_loads_are_the_same_model(tiny):
    again = load_checkpoint(TINY, device="cpu")
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(tiny.model, ids), _logits(again.model, ids))
    assert tiny.config.moe.num_experts == 16 and tiny.model.mtp is not None
    assert tiny.tokenizer is not None and tiny.eos_token_ids


def test_a_tensor_seed_depends_on_its_name_only():
    assert tensor_seed(0, "layers.0.mlp.gate.weight") == tensor_seed(0, "layers.0.mlp.gate.weight")
    assert tensor_seed(0, "layers.0.mlp.gate.weight") != tensor_seed(0, "layers.1.mlp.gate.weight")
    assert tensor_seed(0, "x") != tensor_seed(1, "x")


def test_experts_are_rows_of_one_shared_store(tiny):
    blocks = sparse_blocks(tiny.model)
    assert len(blocks) == 4  # 3 layers + the MTP layer
    stores = {id(b.expert_store[0]) for b in blocks}
    assert len(stores) == 1 and all(len(b.experts) == 0 for b in blocks)  # no module per expert
    rows = [r for b in blocks for r in b.store_rows]
    assert max(rows) < SPECS["moe-synth-tiny"].store_rows and len(set(rows)) > 1
    gate_up, down = blocks[1].expert_weights(5)
    row = blocks[1].store_rows[5]
    assert torch.equal(gate_up, blocks[1].expert_store[0][row]) and torch.equal(down, blocks[1].expert_store[1][row])


def test_the_router_is_skewed_and_drifts_with_position(tiny):
    block = sparse_blocks(tiny.model)[0]
    spec = SPECS["moe-synth-tiny"]
    x = torch.randn(512, tiny.config.hidden_size, generator=torch.Generator().manual_seed(3))
    counts = []
    for phase in (0, 4):
        positions = torch.full((512,), phase * spec.drift_tokens)
        _, ids = block.route(x, positions)
        counts.append(torch.bincount(ids.flatten(), minlength=16))
    for c in counts:  # Zipf: the 4 hottest of 16 experts take well over a uniform router's quarter of the routes
        assert c.topk(4).values.sum() > 0.5 * c.sum()
    hot = [set(c.topk(4).indices.tolist()) for c in counts]
    assert hot[0] != hot[1]  # the hot set moved along the positions
    with pytest.raises(ValueError, match="positions are required"):
        block.route(x)


def test_a_small_expert_cache_gives_the_all_resident_logits(tiny):
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    reference = _logits(tiny.model, ids)
    model = load_checkpoint(TINY, device="cpu").model
    cache = ExpertCache(model, torch.device("cpu"), EventBus(), slots=3)
    assert cache.store_mib == pytest.approx(cache.expert_mib * SPECS["moe-synth-tiny"].store_rows)
    assert cache.store_mib < cache.all_experts_mib  # the store holds its distinct rows once
    torch.testing.assert_close(_logits(model, ids), reference)
    assert sum(cache.stats.misses) > 0 and sum(cache.stats.evictions) > 0


def experts_gib(name: str) -> float:
    """GiB of every routed expert of `random:NAME` in bf16 as distinct weights (what all-resident slots hold)."""
    cfg = SPECS[name].config
    layers = cfg.num_hidden_layers + cfg.mtp.num_layers
    return layers * cfg.moe.num_experts * 3 * cfg.hidden_size * cfg.moe.moe_intermediate_size * 2 / 2**30


def test_names_and_sizes():
    assert is_synthetic("random:moe-80b") and not is_synthetic("random:0.6b") and not is_synthetic("/x/random:moe-80b")
    assert experts_gib("moe-80b") == pytest.approx(147.0)  # 49 sparse layers (48 + MTP) x 512 x 6 MiB: over the card
    assert experts_gib("moe-80b-40l") < 130  # the comparison variant's experts all fit an H200
    cfg = SPECS["moe-80b"].config
    assert (cfg.num_hidden_layers, cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.hidden_size,
            cfg.moe.moe_intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size) == (48, 512, 10, 2048, 512, 16, 2, 256, 151936)


def test_quantize_takes_fp8_and_int4_and_refuses_the_other_forms_in_one_line():
    """FP8 and INT4 are generated into the store (tests/engine/test_engine_fp8_experts.py,
    tests/engine/test_engine_int4_experts.py); the other forms have none."""
    with pytest.raises(ConfigError, match="fp8 \\(per channel\\) and int4 \\(per group\\) only") as err:
        load_checkpoint(TINY, device="cpu", quantize="fp8-block")
    assert err.value.param == "quantize" and "fp8-block" in str(err.value)


def test_int4_experts_are_the_16_bit_store_rounded_per_group(tiny):
    """`--quantize int4`: each store row is the 16-bit row rounded as `--quantize int4` rounds a projection (codes
    in the kernels' layout, a scale and offset per group), and the 80B's experts take ~27 % of bf16's bytes."""
    from engine.exec.experts.pool import int4_expert_bytes
    from engine.model.moe_quant import Int4Experts, round_int4
    from engine.model.quant.rtn import int4_group_size

    q = load_checkpoint(TINY, device="cpu", quantize="int4")
    block, plain = sparse_blocks(q.model)[0], sparse_blocks(tiny.model)[0]
    quant = block.expert_quant
    assert isinstance(quant, Int4Experts) and block.expert_store[0].dtype == torch.int32
    H, I = plain.gate.in_features, plain.intermediate_size
    assert (quant.gate_up_group, quant.down_group) == (int4_group_size(H), int4_group_size(I))
    for got, want, group, scales in ((block.expert_store[0], plain.expert_store[0], quant.gate_up_group,
                                      quant.tensors()[:2]),
                                     (block.expert_store[1], plain.expert_store[1], quant.down_group,
                                      quant.tensors()[2:])):
        codes, s, o = round_int4(want, group, scales[0].dtype)
        assert torch.equal(got, codes) and torch.equal(scales[0], s) and torch.equal(scales[1], o)
    assert block.store_rows == plain.store_rows
    cfg = SPECS["moe-80b"].config
    H, I = cfg.hidden_size, cfg.moe.moe_intermediate_size
    int4 = int4_expert_bytes(H, I, int4_group_size(H), int4_group_size(I), 2)  # fp16 scales for a bf16 model
    assert int4 / (3 * H * I * 2) == pytest.approx(0.266, abs=0.001)
    assert experts_gib("moe-80b") * int4 / (3 * H * I * 2) == pytest.approx(39.05, abs=0.01)  # README's ~39 GiB
