"""Batched MTP speculative decoding is lossless: greedy fp32 output with --batch-mtp is token-for-token the
output without it, for 20 prompts at batch sizes 1 and 6, and drafts are really accepted along the way."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(20, seed=42, lengths=(3, 120))
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(ckpt):
    with one_thread():
        return tokens_of(run_all(make_engine(ckpt, batch=6), PROMPTS, GREEDY))


def _accepted_drafts(engine, bus: EventBus) -> float:
    accs = [e.acceptance for e in bus.history() if e.type == "slot" and e.acceptance is not None]
    return max(accs) if accs else 0.0


@pytest.mark.parametrize("batch,depth", [(1, 2), (6, 2), (6, 1)])
def test_mtp_output_is_identical_to_plain_decoding(ckpt, plain_outputs, batch, depth):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, batch=batch, batch_mtp=True, mtp_depth=depth)
    got = tokens_of(run_all(engine, PROMPTS, GREEDY))
    assert engine.mtp_on, engine.mtp_off_reason
    mismatched = [rid for rid in plain_outputs if got[rid] != plain_outputs[rid]]
    assert not mismatched, f"MTP changed the output of {mismatched}"
    # Verification accepted drafts (so the accept path and the KV rollback after a rejection both ran).
    assert _accepted_drafts(engine, bus) > 0


def test_mtp_sampling_with_temperature_completes_and_tracks_acceptance_per_position(ckpt):
    engine = make_engine(ckpt, batch=4, batch_mtp=True, mtp_depth=3)
    params = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)
    reqs = [engine.add_request(f"t{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    while engine.has_work:
        engine.step()
    for req in reqs:
        assert req.num_output_tokens == 24 and req.finish_reason == "length"
        assert len(req.draft_proposed) == 3
        # Acceptance is a prefix: a later draft position is never accepted more often than an earlier one.
        assert req.draft_accepted[0] >= req.draft_accepted[1] >= req.draft_accepted[2]


@pytest.fixture(scope="module")
def text_prompts():
    from engine.model import resolve_model_path
    from engine.model.tokenizer import Tokenizer

    path = resolve_model_path("builtin:strata-tiny")
    if not (path / "heldout_sample.txt").exists():
        pytest.skip("strata-tiny has no held-out sample")
    tok = Tokenizer.from_dir(path)
    words = (path / "heldout_sample.txt").read_text().split()
    return [tok.encode(" ".join(words[i * 37: i * 37 + 25])) for i in range(20)]


@pytest.mark.parametrize("batch", [1, 6])
def test_mtp_is_lossless_on_the_trained_strata_tiny(text_prompts, batch):
    """The embedded model's trained MTP head: most drafts are accepted, output unchanged."""
    from engine.config import EngineConfig
    from engine.orchestration.engine import Engine

    def run(mtp: bool):
        cfg = EngineConfig(model="builtin:strata-tiny", device="cpu", dtype="float32", batch=batch, context=512,
                           prefill_chunk_tokens=64, step_token_budget=128, batch_mtp=mtp, mtp_depth=2)
        bus = EventBus(history=100000)
        engine = Engine(cfg, bus, tier_budget_mib=16.0, block_tokens=16)
        return tokens_of(run_all(engine, text_prompts, GREEDY)), engine, bus

    plain, _, _ = run(False)
    with_mtp, engine, bus = run(True)
    assert engine.mtp_on
    assert with_mtp == plain
    assert _accepted_drafts(engine, bus) > 0.5
