"""The sampler: greedy, seeded sampling, top-p, and speculative acceptance that keeps the target distribution."""

from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.exec.sampler import make_generator, sample_with_drafts, target_probs


def test_greedy_accepts_drafts_while_they_equal_the_argmax():
    logits = torch.full((2, 4, 10), -5.0)
    argmaxes = [[3, 7, 1, 4], [2, 2, 9, 0]]
    for b, row in enumerate(argmaxes):
        for j, tok in enumerate(row):
            logits[b, j, tok] = 5.0
    drafts = torch.tensor([[3, 7, 5], [6, 2, 9]])  # row 0: two accepted, then 5 != 1; row 1: rejected at once
    params = [SamplingParams(temperature=0.0)] * 2
    res = sample_with_drafts(logits, drafts, params, [make_generator(0), make_generator(1)])
    assert res.accepted == [2, 0]
    assert res.tokens == [[3, 7, 1], [2]]


def test_all_drafts_accepted_adds_the_bonus_token():
    logits = torch.full((1, 3, 6), 0.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 5] = 9.0
    res = sample_with_drafts(logits, torch.tensor([[1, 2]]), [SamplingParams(temperature=0.0)], [make_generator(0)])
    assert res.accepted == [2] and res.tokens == [[1, 2, 5]]


def test_seeded_requests_reproduce_and_seeds_differ():
    logits = torch.randn(1, 1, 50)
    p = [SamplingParams(temperature=1.0)]
    draws = [sample_with_drafts(logits, None, p, [make_generator(s)]).tokens[0][0] for s in (7, 7)]
    assert draws[0] == draws[1]
    many = {sample_with_drafts(logits, None, p, [make_generator(s)]).tokens[0][0] for s in range(40)}
    assert len(many) > 3


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    probs = target_probs(logits, torch.tensor([1.0]), torch.tensor([0.7]))
    assert torch.allclose(probs[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_speculative_rejection_sampling_preserves_the_target_distribution():
    """First emitted token's frequency over many rows matches softmax(logits), whatever the draft was."""
    n = 6000
    target = torch.tensor([0.1, 0.6, 0.25, 0.05])
    logits = torch.log(target).view(1, 1, 4).expand(n, 2, 4).clone()
    drafts = torch.full((n, 1), 2)  # a draft that is often wrong
    params = [SamplingParams(temperature=1.0)] * n
    gens = [make_generator(i) for i in range(n)]
    res = sample_with_drafts(logits, drafts, params, gens)
    first = torch.tensor([row[0] for row in res.tokens])
    freq = torch.bincount(first, minlength=4).float() / n
    assert torch.allclose(freq, target, atol=0.025), freq
    assert 0.2 < sum(res.accepted) / n < 0.3  # accepted with probability p(draft) = 0.25


def test_greedy_rows_give_the_same_result_on_the_general_path_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 30, generator=gen)
    best = logits.argmax(-1)
    drafts = torch.stack([best[0, :3].clone(), best[1, :3].clone()])
    drafts[0, 2] = (drafts[0, 2] + 1) % 30  # row 0: third draft wrong
    fast = sample_with_drafts(logits[:1], drafts[:1], [SamplingParams(temperature=0.0)], [make_generator(0)])
    mixed = sample_with_drafts(logits, drafts, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                               [make_generator(0), make_generator(1)])
    assert fast.accepted[0] == mixed.accepted[0] == 2
    assert fast.tokens[0] == mixed.tokens[0] == best[0, :3].tolist()


def test_temperatures_below_the_epsilon_are_greedy_and_never_nan():
    """1e-45..1e-38 used to pass validation and give NaN probabilities (token vocab-1 repeated)."""
    from engine.api import GREEDY_BELOW_TEMPERATURE

    logits = torch.randn(3, 1, 40)
    tiny = torch.tensor([1e-45, 1e-38, GREEDY_BELOW_TEMPERATURE / 2])
    probs = target_probs(logits.expand(3, 1, 40), tiny, torch.ones(3))
    assert not probs.isnan().any()
    assert probs.argmax(-1).flatten().tolist() == [int(logits[i, 0].argmax()) for i in range(3)]
    sampled = SamplingParams(temperature=1e-40)
    assert sampled.temperature == 0.0  # greedy by contract, for every sampler
    mixed = [sampled, SamplingParams(temperature=1.0)]
    res = sample_with_drafts(logits[:2], None, mixed, [make_generator(0), make_generator(1)])
    assert res.tokens[0] == [int(logits[0, 0].argmax())]
