"""Sampling parameters through the engine, MTP on and off (issue 15, item 6): greedy with penalties, a logit
bias and top_k is token-for-token the same with --batch-mtp; logprobs come back one per token; sampled output
with MTP drafts still follows the (penalized) target distribution."""

from __future__ import annotations

import math

import pytest

from engine.api import SamplingParams
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(6, seed=61, lengths=(5, 80))
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=3.0),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias=((7, 3.0), (11, -50.0))),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, top_k=5, min_p=0.1, logprobs=2),
]


def _run(engine, prompts, params_list):
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, params)
    outs: dict = {}
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.fixture(scope="module")
def plain(ckpt):
    with one_thread():
        engine = make_engine(ckpt, batch=4)
        return _run(engine, PROMPTS, PARAMS)


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_with_penalties_bias_and_truncation_is_identical_with_mtp(ckpt, plain, depth):
    bus = EventBus(history=100000)
    engine = make_engine(ckpt, bus=bus, batch=4, batch_mtp=True, mtp_depth=depth)
    got = _run(engine, PROMPTS, PARAMS)
    assert engine.mtp_on, engine.mtp_off_reason
    assert tokens_of(got) == tokens_of(plain)
    assert sum(engine.snapshot.mtp.draft_accepted) > 0  # drafts were really verified and accepted
    plain_ids = tokens_of(plain)
    unpenalized = tokens_of(_run(make_engine(ckpt, batch=4), PROMPTS[:1],
                                 [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]))
    assert unpenalized["r0"] != plain_ids["r0"]  # the penalties did change the output


def test_logprobs_come_one_per_token_with_mtp_and_match_greedy(ckpt, plain):
    engine = make_engine(ckpt, batch=4, batch_mtp=True, mtp_depth=2)
    got = _run(engine, PROMPTS, PARAMS)
    for outs in (got, plain):
        ids = [t for o in outs["r3"] for t in o.token_ids]
        lps = [lp for o in outs["r3"] for lp in (o.logprobs or [])]
        assert [lp.token_id for lp in lps] == ids and len(ids) == 16
        assert all(len(lp.top) == 2 and lp.logprob <= 0.0 for lp in lps)
        assert all(o.logprobs is None for o in outs["r0"])  # not asked: not computed
    mtp_lps = [lp.logprob for o in got["r3"] for lp in o.logprobs]
    plain_lps = [lp.logprob for o in plain["r3"] for lp in o.logprobs]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(mtp_lps, plain_lps))


def test_sampled_penalized_output_with_mtp_keeps_the_distribution_of_plain_decoding(ckpt):
    """The first two tokens of many seeded requests: their frequencies with MTP match those without."""
    n = 300
    prompt = PROMPTS[2][:12]
    params = [SamplingParams(max_tokens=2, temperature=1.5, ignore_eos=True, frequency_penalty=1.0, top_k=3,
                             seed=s) for s in range(n)]

    def pairs(mtp: bool):
        engine = make_engine(ckpt, batch=8, batch_mtp=mtp, mtp_depth=1, queue_max=n)
        return [tuple(v) for v in tokens_of(_run(engine, [prompt] * n, params)).values()]

    plain_pairs, mtp_pairs = pairs(False), pairs(True)
    # Same seeds, different random draws (MTP draws two uniforms per position): compare distributions, by
    # total variation distance of the first token and of the pair, against a bound that n = 300 over at most 9 cells leaves.
    for key in (lambda p: p[0], lambda p: p):
        a = _freq([key(p) for p in plain_pairs])
        b = _freq([key(p) for p in mtp_pairs])
        tvd = 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b))
        assert tvd < 0.25, (tvd, a, b)


def _freq(items):
    out: dict = {}
    for item in items:
        out[item] = out.get(item, 0) + 1 / len(items)
    return out
