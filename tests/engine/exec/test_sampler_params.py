"""vLLM-parity sampling parameters in the sampler (issue 15, item 6): top_k, min_p, repetition / presence /
frequency penalties, logit_bias and logprobs, with and without MTP drafts."""

from __future__ import annotations

import math

import pytest
import torch

from engine.api import SamplingParams
from engine.exec.sampler import make_generator, penalize, sample_with_drafts, target_probs


def test_top_k_and_min_p_truncate_and_renormalize():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    one = torch.ones(1)
    top2 = target_probs(logits, one, one, top_k=torch.tensor([2.0]), min_p=torch.zeros(1))
    assert torch.allclose(top2[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    minp = target_probs(logits, one, one, top_k=torch.zeros(1), min_p=torch.tensor([0.25]))  # keep >= 0.125
    assert torch.allclose(minp[0, 0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_penalties_follow_openai_and_vllm_formulas():
    logits = torch.tensor([[[2.0, -1.0, 0.5, 3.0, 1.0]]])
    prompt, output = [4], [0, 0, 2]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((1, 5.0),))
    got = penalize(logits, None, [p], [(prompt, output)])[0, 0]
    # repetition (prompt or output tokens): positive / 2, negative * 2; then frequency x count, presence once.
    want = torch.tensor([2.0 / 2 - 0.25 * 2 - 0.5, -1.0 + 5.0, 0.5 / 2 - 0.25 - 0.5, 3.0, 1.0 / 2])
    assert torch.allclose(got, want), got


def test_logit_bias_forces_a_token_greedy_and_logprobs_are_the_raw_model_ones():
    logits = torch.randn(1, 1, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.0, logit_bias=((17, 100.0),), logprobs=3)
    res = sample_with_drafts(logits, None, [p], [make_generator(0)], [([1, 2], [])])
    assert res.tokens == [[17]]
    raw = torch.log_softmax(logits[0, 0], -1)
    (lp,) = res.logprobs[0]
    assert lp.token_id == 17 and math.isclose(lp.logprob, float(raw[17]), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == raw.topk(3).indices.tolist()
    assert res.logprobs is not None and sample_with_drafts(logits, None, [SamplingParams()], [make_generator(0)]
                                                           ).logprobs is None


def test_penalized_greedy_verify_accepts_what_plain_decoding_would_emit():
    """Position j is scored with the drafts before it counted as output: a draft that plain penalized greedy
    decoding would have emitted is accepted, one it would not is rejected."""
    v = 6
    logits = torch.full((1, 3, v), 0.0)
    logits[0, :, 3] = 2.0  # token 3 is the argmax everywhere ...
    logits[0, :, 4] = 1.5  # ... until it has been emitted once: 2.0 - 1.0 < 1.5
    p = SamplingParams(temperature=0.0, presence_penalty=1.0, ignore_eos=True)
    res = sample_with_drafts(logits, torch.tensor([[3, 4]]), [p], [make_generator(0)], [([0], [])])
    assert res.accepted == [2] and res.tokens == [[3, 4, 3]]  # both seen once: 3 (1.0) beats 4 (0.5)
    rejected = sample_with_drafts(logits, torch.tensor([[3, 3]]), [p], [make_generator(0)], [([0], [])])
    assert rejected.accepted == [1] and rejected.tokens == [[3, 4]]


def test_sampled_verify_with_penalties_keeps_the_target_distribution():
    """Statistically, on CPU: with MTP drafts and penalties, the first token follows the penalized target p0
    and, after an accepted draft d, the second follows p1 penalized with d counted as output."""
    n = 8000
    base = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    logits = base.view(1, 1, 4).expand(n, 2, 4).clone()
    draft = 1
    p = SamplingParams(temperature=1.0, frequency_penalty=0.7, top_k=3)
    history = ([0], [2])  # token 2 was emitted once already
    res = sample_with_drafts(logits, torch.full((n, 1), draft), [p] * n, [make_generator(i) for i in range(n)],
                             [history] * n)

    def target(counts: list[float]) -> torch.Tensor:
        adjusted = base - 0.7 * torch.tensor(counts)
        return target_probs(adjusted.view(1, 1, 4), torch.ones(1), torch.ones(1), top_k=torch.tensor([3.0]),
                            min_p=torch.zeros(1))[0, 0]

    p0 = target([0, 0, 1, 0])
    p1 = target([0, 1, 1, 0])  # the accepted draft counts as output at position 1
    first = torch.bincount(torch.tensor([row[0] for row in res.tokens]), minlength=4).float() / n
    assert torch.allclose(first, p0, atol=0.02), (first, p0)
    seconds = [row[1] for row in res.tokens if len(row) == 2]
    assert abs(len(seconds) / n - float(p0[draft])) < 0.02  # accepted with probability p0(draft)
    second = torch.bincount(torch.tensor(seconds), minlength=4).float() / len(seconds)
    assert torch.allclose(second, p1, atol=0.03), (second, p1)


def test_greedy_rows_read_the_steps_argmax_and_penalized_or_sampled_rows_do_not():
    """A decode graph hands its argmax (`best`) along: greedy rows take it as their token (no argmax launch after
    the replay); a penalty changes the logits, so a penalized row takes the argmax of its penalized logits."""
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]], [[4.0, 0.0, 1.0, 0.5]], [[0.0, 0.0, 0.0, 0.0]]])
    best = logits.argmax(dim=-1)
    greedy = [SamplingParams(temperature=0.0)] * 2
    gens = [make_generator(1), make_generator(2)]
    assert sample_with_drafts(logits, None, greedy, gens, best=best).tokens == [[1], [0]]
    # the step's own argmax is what is read (a stand-in tells them apart): rows past the params are padding
    stand_in = torch.tensor([[2], [3], [1]])
    assert sample_with_drafts(logits, None, greedy, gens, best=stand_in).tokens == [[2], [3]]
    biased = [SamplingParams(temperature=0.0, logit_bias=((2, 10.0),))] * 2
    assert sample_with_drafts(logits, None, biased, gens, [([], [])] * 2, best=stand_in).tokens == [[2], [2]]
    sampled = [SamplingParams(temperature=1.0, seed=3, logit_bias=((3, 100.0),))] * 2
    assert sample_with_drafts(logits, None, sampled, gens, [([], [])] * 2, best=stand_in).tokens == [[3], [3]]


def test_tiny_top_p_and_repetition_penalty_stay_correct_at_the_float32_edge():
    """Valid values below float32's smallest denormal (1.4e-45) round to 0 on the device: top_p then kept no
    token and the penalty divided by 0, and every draw came out as the vocabulary's last id."""
    vocab = 8192
    logits = torch.randn(2, 1, vocab, generator=torch.Generator().manual_seed(1)) * 3
    best = logits.argmax(-1)
    params = [SamplingParams(temperature=1.0, top_p=1e-46), SamplingParams(temperature=1.0, top_p=5e-324)]
    for seed in range(4):
        res = sample_with_drafts(logits, None, params, [make_generator(seed), make_generator(seed + 9)])
        assert res.tokens == best.tolist()
    history = [5, 77, 1234]  # seen: with a vanishing penalty the seen token with the largest positive logit wins
    logits[0, 0, history] = torch.tensor([0.5, 1.5, -2.0])
    want = 77
    p = SamplingParams(temperature=1.0, repetition_penalty=1e-46)
    for seed in range(4):
        res = sample_with_drafts(logits[:1], None, [p], [make_generator(seed)], [([5], [77, 1234])])
        assert res.tokens == [[want]]
    assert torch.isfinite(penalize(logits[:1], None, [p], [([5], [77, 1234])])).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_non_finite_logits_name_their_rows_greedy_sampled_and_with_drafts(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.exec.sampler import NonFiniteLogits, sample_isolating_rows

    logits = torch.randn(3, 2, 64, device=device)
    logits[1, 1, 5] = float("nan")
    drafts = logits[:, :1].argmax(-1)
    for params in ([SamplingParams(temperature=0.0)] * 3, [SamplingParams(temperature=0.8, top_p=0.9)] * 3):
        gens = [make_generator(i) for i in range(3)]
        with pytest.raises(NonFiniteLogits) as info:
            sample_with_drafts(logits, drafts, params, gens)
        assert info.value.rows == [1]
        result, failed = sample_isolating_rows(logits, drafts, params, gens, None, lambda exc: False)
        assert list(failed) == [1] and isinstance(failed[1], NonFiniteLogits)
        assert all(t >= 0 for row in result.tokens for t in row)
