"""Prefix reuse through the adaptive tier: a repeated prompt reports cached tokens and gives the same output;
after the tier gives its memory back, the same prompt is computed fresh again."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _admissions(bus: EventBus) -> list:
    return [e for e in bus.history() if e.type == "admission"]


@pytest.mark.parametrize("kv,mtp", [("bf16", False), ("int8", False), ("bf16", True)])
def test_repeated_prompt_reuses_cached_blocks_and_gives_the_same_output(ckpt, kv, mtp):
    bus = EventBus(history=50000)
    engine = make_engine(ckpt, bus=bus, batch=2, kv=kv, batch_mtp=mtp, mtp_depth=2, block_tokens=16)
    prompt = random_prompts(1, seed=31, lengths=(150, 151))[0]
    first = run_all(engine, [prompt], GREEDY, prefix="a")["a0"]
    second = run_all(engine, [prompt], GREEDY, prefix="b")["b0"]
    fresh, reused = _admissions(bus)
    assert fresh.reuse == "fresh" and fresh.cached_tokens == 0
    assert reused.reuse == "reused" and reused.cached_tokens == 144  # whole 16-token blocks of prompt[:-1]
    assert first[-1].cached_tokens == 0 and second[-1].cached_tokens == 144
    assert [t for o in second for t in o.token_ids] == [t for o in first for t in o.token_ids]
    assert engine.tier.copied_in_blocks == 9


def test_a_shared_prefix_with_a_different_tail_reuses_only_the_common_blocks(ckpt):
    bus = EventBus(history=50000)
    engine = make_engine(ckpt, bus=bus, batch=2, block_tokens=16)
    base = random_prompts(1, seed=32, lengths=(100, 101))[0]
    other = base[:40] + [7] * 60
    run_all(engine, [base], GREEDY, prefix="a")
    reused = run_all(engine, [other], GREEDY, prefix="b")
    alone = run_all(make_engine(ckpt, batch=2, block_tokens=16), [other], GREEDY, prefix="b")
    assert _admissions(bus)[-1].cached_tokens == 32
    assert tokens_of(reused) == tokens_of(alone)


def test_after_the_tier_releases_its_blocks_the_prompt_is_computed_fresh(ckpt):
    bus = EventBus(history=50000)
    engine = make_engine(ckpt, bus=bus, batch=1, block_tokens=16)
    prompt = random_prompts(1, seed=33, lengths=(120, 121))[0]
    first = tokens_of(run_all(engine, [prompt], GREEDY, prefix="a"))["a0"]
    held_mib = engine.tier.mib
    assert held_mib > 0
    freed = engine.tier.release(held_mib, "test")
    assert freed == pytest.approx(held_mib)
    again = tokens_of(run_all(engine, [prompt], GREEDY, prefix="b"))["b0"]
    assert _admissions(bus)[-1].reuse == "fresh"
    assert again == first
    shrink = [e for e in bus.history() if e.type == "tier" and e.action == "shrink"]
    assert shrink and shrink[-1].reason == "test" and shrink[-1].mib == pytest.approx(held_mib, rel=0.01)
