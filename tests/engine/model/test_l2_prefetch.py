"""L2 prefetch of the weights ahead (engine.model.l2_prefetch): off on the CPU (a launch then passes empty ranges),
what a launch asks for (each range whole, rounded to the 16-byte granule, within the budget), and the model's
plan (the o projection asks for its MLP's weights, the down projection for the next layer's attention's)."""

from __future__ import annotations

import pytest
import torch

from engine.model import l2_prefetch


def test_prefetch_is_off_on_the_cpu_and_a_launch_asks_for_nothing(monkeypatch):
    monkeypatch.setenv("STRATA_L2_PREFETCH", "1")
    assert l2_prefetch.enable(torch.device("cpu")) is False
    assert l2_prefetch.plan_bytes() == 0
    weight, other = torch.zeros(8, 8), torch.zeros(4, 4)
    assert l2_prefetch.launch_args((other,), weight) == ([weight, 0, weight, 0], False)


def test_a_launch_asks_for_each_range_whole_in_16_byte_granules(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "_on", True)
    anchor, first, second = torch.zeros(4), torch.zeros(3, 7, dtype=torch.bfloat16), torch.zeros(10)
    ranges, on = l2_prefetch.launch_args((first, second), anchor)
    assert on and ranges == [first, 32, second, 32]  # 42 bytes -> 32, 40 -> 32
    ranges, on = l2_prefetch.launch_args((first,), anchor)
    assert on and ranges == [first, 32, anchor, 0]
    assert l2_prefetch.launch_args((), anchor) == ([anchor, 0, anchor, 0], False)


def test_pick_keeps_the_read_order_and_stops_at_the_first_weight_past_the_budget():
    a, b, c = torch.zeros(100), torch.zeros(50), torch.zeros(10)  # 400, 200, 40 bytes
    assert l2_prefetch.pick([a, b, c], 10_000) == (a, b)  # at most RANGES
    assert l2_prefetch.pick([a, b], 599) == (a,)
    assert l2_prefetch.pick([b, a], 599) == (b,)  # a later, smaller weight does not jump the queue
    assert l2_prefetch.pick([a, b], 0) == ()
    assert l2_prefetch.pick([torch.zeros(8, 8).t(), c], 10_000) == ()  # a range must be one span of bytes
    assert l2_prefetch.pick([torch.zeros(64)[1:], c], 10_000) == ()  # starting on a 16-byte boundary


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_the_plan_names_the_next_products_weights_within_the_budget(fused):
    from engine.model import CausalLM
    from engine.model.random_checkpoint import random_config

    model = CausalLM(random_config(num_hidden_layers=3))
    if fused:
        model.fuse_projections()
    layers = model.layers
    model.plan_prefetch(1 << 30)
    for i, layer in enumerate(layers):
        mlp, attn = layer.mlp, layer.self_attn
        mlp_first = (mlp.gate_up_proj.weight, mlp.down_proj.weight) if fused else (mlp.gate_proj.weight,
                                                                                   mlp.up_proj.weight)
        assert attn.prefetch == mlp_first, i
        if i + 1 < len(layers):
            after = layers[i + 1].self_attn
            assert mlp.prefetch == ((after.qkv_proj.weight, after.o_proj.weight) if fused
                                    else (after.q_proj.weight, after.k_proj.weight)), i
    assert layers[-1].mlp.prefetch == ()  # the LM head comes next: far larger than L2
    asked = [t for layer in layers for t in layer.self_attn.prefetch + layer.mlp.prefetch]
    assert len(asked) == 2 * len(layers) + 2 * (len(layers) - 1)
    assert model.prefetch_bytes() == sum(t.numel() * t.element_size() for t in asked)  # bench profile's figure
    first = mlp_first[0]
    model.plan_prefetch(first.numel() * first.element_size())  # room for the first weight only
    assert all(layer.self_attn.prefetch == (layer.mlp.gate_up_proj.weight if fused else layer.mlp.gate_proj.weight,)
               for layer in layers)
    model.plan_prefetch(0)
    assert not any(layer.self_attn.prefetch or layer.mlp.prefetch for layer in layers)
    assert model.prefetch_bytes() == 0
