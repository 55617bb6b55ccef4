"""Engine.close gives its memory back even while something still holds the engine (benchmarks build one
engine per configuration in one process, and a dropped engine still referenced keeps its GPU-filling tier)."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.errors import EngineDead
from tests.engine.engine_helpers import make_engine, run_all

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_close_frees_tier_kv_and_weights_of_an_engine_still_referenced(ckpt, one_torch_thread) -> None:
    engine = make_engine(ckpt, batch=2)
    run_all(engine, [list(range(3, 70)), list(range(5, 40))], GREEDY)  # the tier now holds prefix blocks
    assert engine.tier.mib > 0 and engine.kv.nbytes > 0
    kept = engine  # the reference a leak would be: close must not depend on the engine being collected

    kept.close()

    assert kept.tier.mib == 0 and kept.tier.capacity_blocks == 0
    assert kept.kv.nbytes == 0
    assert all(p.device.type == "meta" for p in kept.lm.model.parameters())
    assert kept.health().ready is False and "closed" in kept.health().reason
    with pytest.raises(EngineDead):
        kept.add_request("after", [3, 4, 5], GREEDY)
    assert kept.step() == []
    tiers = [e for e in kept.bus.history() if e.type == "tier" and "closed" in getattr(e, "reason", "")]
    assert tiers, "the tier's shrink on close is published like any other"
