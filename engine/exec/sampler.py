"""Sampling: penalties and logit bias, temperature, top-p / top-k / min-p, per-request seeded generators,
logprobs, and speculative acceptance of MTP drafts.

One function serves plain decode and MTP verify: `sample_with_drafts(logits [B, T, V], drafts [B, T-1])`.
Drafts are proposed greedily (argmax of the MTP head), i.e. from a one-hot draft distribution q, so standard
speculative rejection sampling reduces to: accept draft d at position j with probability p_j(d); at the first
rejection sample from p_j with d removed (the residual max(0, p - q), renormalized); if all K are accepted,
sample the bonus token from p_K. Greedy rows use p = one-hot(argmax), which turns the same rule into "accept
while the draft equals the argmax" -- so the output is token-for-token what plain greedy decoding gives.

Penalties depend on what came before each position: at verify position j the drafts before j count as
output (they are what the row emits if they are accepted), so every position is scored against the
distribution plain decoding would have used there, and acceptance keeps that distribution.

Random numbers come from per-request CPU generators (seeded: reproducible on any device); only the small
uniform draws travel to the device, and only [B, T] token ids come back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.api import GREEDY_BELOW_TEMPERATURE, SamplingParams, TokenLogprob
from engine.errors import RequestRejected

History = tuple[Sequence[int], Sequence[int]]
MIN_REPETITION_PENALTY = 1e-6  # logits / 1e-6 stay finite in float32 and make the seen maximum certain  # (prompt token ids, output token ids so far) of one row


NO_TOKEN = -1  # a row's token id where its logits were not finite: flagged on the device, read with the tokens


class NonFiniteLogits(RuntimeError):
    """The model's logits for a row hold NaN or inf: broken weights (or a config that does not match them)."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__("the model produced non-finite logits (NaN or inf): its weights or config.json are "
                         "broken, so no token can be sampled")
        self.rows = rows


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded when the request gave a seed, otherwise from entropy."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def request_generator(params: SamplingParams, vocab_size: int) -> torch.Generator:
    """Check what sampling one request needs and make its generator; RequestRejected names the parameter
    (a seed torch refuses, a logit_bias id outside the vocabulary) before any engine state is touched."""
    bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected(f"logit_bias token id {bad} is outside this model's vocabulary (0..{vocab_size - 1})",
                              param="logit_bias")
    try:
        return make_generator(params.seed)
    except (ValueError, OverflowError, TypeError, RuntimeError) as exc:
        raise RequestRejected(f"seed={params.seed}: {exc}", param="seed") from None


@dataclass
class SampleResult:
    """Per row: how many drafts were accepted and the tokens to emit (accepted drafts, then one more)."""

    accepted: list[int]
    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob] | None] | None = None  # per row, one per emitted token; None: none asked


def penalize(logits: torch.Tensor, drafts: torch.Tensor | None, params: list[SamplingParams],
             histories: list[History]) -> torch.Tensor:
    """Logits [B, T, V] with each row's repetition / presence / frequency penalties and logit bias applied.

    Output counts at position j include the row's drafts before j (see the module docstring). Only rows with
    `params.penalized` are touched; a few kernels per such row.
    """
    b, t, v = logits.shape
    out = logits.float().clone()
    device = out.device
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        prompt_ids, output_ids = histories[i]
        counts = torch.zeros(v, device=device)
        if len(output_ids):
            ids = torch.as_tensor(list(output_ids), device=device)
            counts.scatter_add_(0, ids, torch.ones(len(ids), device=device))
        counts = counts.expand(t, v).clone()  # [T, V]
        if drafts is not None and t > 1:
            onehot = torch.zeros(t - 1, v, device=device).scatter_(1, drafts[i, :t - 1].view(-1, 1), 1.0)
            counts[1:] += onehot.cumsum(dim=0)
        row = out[i]  # [T, V]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if len(prompt_ids):
                in_prompt = torch.zeros(v, dtype=torch.bool, device=device)
                in_prompt[torch.as_tensor(list(prompt_ids), device=device)] = True
                seen = seen | in_prompt
            # Clamped: a valid penalty below float32's range (1e-46) divides by 0 (inf logits, NaN
            # probabilities). At MIN_REPETITION_PENALTY the softmax is already saturated, so the result is
            # the one the exact penalty gives.
            penalty = max(p.repetition_penalty, MIN_REPETITION_PENALTY)
            penalized = torch.where(row > 0, row / penalty, row * penalty)
            row = torch.where(seen, penalized, row)
        if p.frequency_penalty:
            row = row - p.frequency_penalty * counts
        if p.presence_penalty:
            row = row - p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids = torch.tensor([tok for tok, _ in p.logit_bias], device=device)
            row = row.index_add(1, ids, torch.tensor([[bias for _, bias in p.logit_bias]] * t, device=device))
        out[i] = row
    return out


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 use_top_p: bool | None = None, top_k: torch.Tensor | None = None,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling distribution per row and position: logits [B, T, V] -> probs [B, T, V] (float32).

    temperature 0 gives one-hot(argmax); top_p < 1 keeps the smallest set whose mass reaches top_p; top_k > 0
    keeps the k most likely; min_p > 0 drops tokens below min_p x the top probability. The most likely token
    is always kept. `use_top_p` (any truncation at all) None reads it from the tensors (a host sync); device
    code passes it.
    """
    logits = logits.float()
    # Below GREEDY_BELOW_TEMPERATURE logits / t overflows to inf (NaN probabilities): such rows are greedy.
    sampled = temperature >= GREEDY_BELOW_TEMPERATURE
    greedy = (~sampled).view(-1, 1, 1)
    safe_t = torch.where(sampled, temperature, torch.ones_like(temperature)).view(-1, 1, 1)
    probs = torch.softmax(logits / safe_t, dim=-1)
    if use_top_p is None:
        use_top_p = bool((top_p < 1.0).any()) or (top_k is not None and bool((top_k > 0).any())) \
            or (min_p is not None and bool((min_p > 0).any()))
    if use_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        keep = before < top_p.view(-1, 1, 1)
        # The most likely token always stays: a top_p that is 0 in float32 (a valid 1e-46 rounds to it) would
        # otherwise keep nothing, and 0/0 probabilities sample the last id of the vocabulary.
        keep[..., 0] = True
        if top_k is not None:
            rank = torch.arange(probs.shape[-1], device=probs.device).view(1, 1, -1)
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1]))
            keep = keep & (rank < k.view(-1, 1, 1))
        if min_p is not None:
            keep = keep & (sorted_p >= min_p.view(-1, 1, 1) * sorted_p[..., :1])
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, probs)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V], u [B] in [0, 1) -> token ids [B]."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).contiguous()).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


@dataclass
class SamplingInputs:
    """What sampling B rows needs besides logits, as device tensors: per-row temperature and top-p, and the
    uniforms drawn from each request's own generator (two per position: accept, then sample). `use_top_p` is a
    static flag (whether any row truncates), so device code that takes these never reads a value on the host.
    The fused MTP step (drafter.verify_and_draft) takes temperature and top_p only: the engine sends rows with
    top_k or min_p down the separate path, which passes them too."""

    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    uniforms: torch.Tensor  # [B, 2T] float32
    use_top_p: bool
    top_k: torch.Tensor  # [B] float32 (0: off)
    min_p: torch.Tensor  # [B] float32 (0: off)


def sampling_inputs(params: list[SamplingParams], generators: list[torch.Generator], positions: int,
                    device: torch.device | str, rows: int | None = None) -> SamplingInputs:
    """Draw each request's uniforms (in request order, from its own generator) and pack the per-row parameters.

    `rows` pads to a batch bucket (padding rows: greedy, no draws)."""
    rows = len(params) if rows is None else rows
    pad = rows - len(params)
    temperature = [p.temperature for p in params] + [0.0] * pad
    top_p = [p.top_p for p in params] + [1.0] * pad
    top_k = [float(p.top_k) for p in params] + [0.0] * pad
    min_p = [p.min_p for p in params] + [0.0] * pad
    u = torch.stack([torch.rand(2 * positions, generator=g) for g in generators]
                    + [torch.zeros(2 * positions)] * pad)
    host = torch.cat([torch.tensor([temperature, top_p, top_k, min_p], dtype=torch.float32).T, u], dim=1)
    packed = host.to(device)  # one copy over
    return SamplingInputs(packed[:, 0], packed[:, 1], packed[:, 4:], any(p.truncated for p in params),
                          packed[:, 2], packed[:, 3])


def sample_on_device(logits: torch.Tensor, drafts: torch.Tensor | None, temperature: torch.Tensor,
                     top_p: torch.Tensor, uniforms: torch.Tensor, use_top_p: bool, top_k: torch.Tensor | None = None,
                     min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling math on the device: logits [B, T, V], drafts [B, T-1] or None -> (accepted [B], tokens
    [B, T]); a row emits tokens[:accepted + 1]. No host reads: it runs inside a captured graph too."""
    b, t, _ = logits.shape
    k = t - 1
    device = logits.device
    probs = target_probs(logits, temperature, top_p, use_top_p, top_k, min_p)  # [B, T, V]
    u_accept, u_sample = uniforms[:, :t], uniforms[:, t:]
    if k > 0 and drafts is not None:
        p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
        ok = (u_accept[:, :k] < p_draft).long()
        accepted = ok.cumprod(dim=-1).sum(dim=-1)  # [B]: leading accepted drafts
        at = accepted.view(b, 1, 1).expand(b, 1, probs.shape[-1])
        p_at = probs.gather(1, at).squeeze(1)  # [B, V]: the distribution at the first rejection (or bonus)
        rejected = accepted < k
        d_at = drafts.gather(1, accepted.clamp(max=k - 1).view(b, 1)).squeeze(1)
        residual = p_at.scatter(-1, d_at.view(b, 1), 0.0)
        # A one-hot p_at that rejected its own draft cannot happen (p(d)=1 always accepts); guard the sum anyway.
        residual_ok = (residual.sum(-1, keepdim=True) > 0) & rejected.view(b, 1)
        p_final = torch.where(residual_ok, residual, p_at)
        final = _draw(p_final, u_sample.gather(1, accepted.view(b, 1)).squeeze(1))
        j = torch.arange(t, device=device).view(1, t)
        padded = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
        tokens = torch.where(j < accepted.view(b, 1), padded, final.view(b, 1))
    else:
        accepted = torch.zeros(b, dtype=torch.long, device=device)
        tokens = _draw(probs[:, 0], u_sample[:, 0]).view(b, 1)
    return accepted, tokens


def sample_with_drafts(
    logits: torch.Tensor,
    drafts: torch.Tensor | None,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: list[History] | None = None,
    best: torch.Tensor | None = None,
    check_finite: bool = True,
) -> SampleResult:
    """Sample the next token(s) of B rows. logits [B, T, V]; drafts [B, T-1] long on the same device, or None.

    Rows beyond len(params) are batch padding and are ignored. `histories` (prompt and output ids per row)
    are needed when a row is `penalized`. `best`: the logits' argmax [B, T] where the step computed it already
    (a decode graph), for greedy rows without penalties. NonFiniteLogits (naming the rows) when a row's
    logits hold NaN or inf: the check is one reduction on the device, and its answer travels back in the
    token copy the step makes anyway (a row's tokens become -1), so it costs no extra host sync.
    """
    rows = len(params)
    raw = logits = logits[:rows]
    finite = finite_rows(raw) if check_finite else None  # [B]
    drafts = None if drafts is None else drafts[:rows]
    if any(p.penalized for p in params):
        if histories is None:
            raise ValueError("penalties and logit_bias need each row's history")
        logits = penalize(logits, drafts, params, histories)
    if all(p.temperature <= 0 for p in params):
        result = _greedy(logits, drafts, best[:rows] if best is not None and logits is raw else None, finite)
    else:
        inputs = sampling_inputs(params, generators, logits.shape[1], logits.device)
        accepted, tokens = sample_on_device(logits, drafts, inputs.temperature, inputs.top_p, inputs.uniforms,
                                            inputs.use_top_p, inputs.top_k, inputs.min_p)
        result = _to_host(accepted, flag_non_finite(tokens, finite))
    bad = [i for i, toks in enumerate(result.tokens) if NO_TOKEN in toks]
    if bad:
        raise NonFiniteLogits(bad)
    if any(p.logprobs is not None for p in params):
        result.logprobs = token_logprobs(raw, result.tokens, params)
    return result


def token_logprobs(logits: torch.Tensor, tokens: list[list[int]], params: list[SamplingParams]
                   ) -> list[list[TokenLogprob] | None]:
    """Per row that asked for them: each emitted token's logprob under the raw model distribution at its
    position (logits [B, T, V]; row b emitted tokens[b] at positions 0..), and its `logprobs` best tokens."""
    out: list[list[TokenLogprob] | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None or not tokens[i]:
            out.append(None)
            continue
        n = len(tokens[i])
        lp = torch.log_softmax(logits[i, :n].float(), dim=-1)  # [n, V]
        chosen = lp.gather(1, torch.tensor(tokens[i], device=lp.device).view(n, 1)).squeeze(1).tolist()
        if p.logprobs > 0:
            top_lp, top_ids = lp.topk(min(p.logprobs, lp.shape[-1]), dim=-1)
            tops = [tuple(zip(ids, vals)) for ids, vals in zip(top_ids.tolist(), top_lp.tolist())]
        else:
            tops = [()] * n
        out.append([TokenLogprob(tok, c, top) for tok, c, top in zip(tokens[i], chosen, tops)])
    return out


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: row b's logits [B, T, V] hold no NaN or inf (one reduction on the device)."""
    return torch.isfinite(logits).flatten(1).all(dim=-1)


def flag_non_finite(tokens: torch.Tensor, finite: torch.Tensor | None) -> torch.Tensor:
    """tokens [B, T] with NO_TOKEN in every row whose logits were not finite (`finite` [B], from `finite_rows`).
    Device ops only: a captured step computes it beside its tokens, and the host learns of broken logits from the
    copy of the tokens it makes anyway (`non_finite_rows`), with no sync of its own."""
    if finite is None:
        return tokens
    return torch.where(finite.view(-1, 1), tokens, NO_TOKEN)


def non_finite_rows(result: SampleResult) -> dict[int, BaseException]:
    """The rows of a result read from the device whose tokens carry NO_TOKEN (their logits were not finite),
    each with its NonFiniteLogits, as `sample_isolating_rows` returns the rows that failed."""
    return {i: NonFiniteLogits([i]) for i, toks in enumerate(result.tokens) if NO_TOKEN in toks}


def _greedy(logits: torch.Tensor, drafts: torch.Tensor | None, best: torch.Tensor | None = None,
            finite: torch.Tensor | None = None) -> SampleResult:
    """All rows greedy: the argmax at each position (`best`, when the step computed it); drafts are accepted
    while they equal it. Same result as the general path with one-hot distributions, in a handful of kernels
    (the common serving case)."""
    best = flag_non_finite(logits.argmax(dim=-1) if best is None else best, finite)  # [B, T]
    k = best.shape[1] - 1
    if k > 0 and drafts is not None:
        accepted = (best[:, :k] == drafts).long().cumprod(dim=-1).sum(dim=-1)
        return _to_host(accepted, best)  # accepted drafts equal the argmax, so the row is the emitted tokens
    # Plain decode: no acceptance to count, and no kernels spent on one (every launch shows on a small model).
    rows = best[:, :1].tolist()
    return SampleResult([0] * len(rows), rows)


def device_result(emitted: torch.Tensor, rows: int) -> SampleResult:
    """The first `rows` rows of a verify sampled on the device (MtpDrafter.verify_and_draft's `emitted`: accepted
    counts and tokens side by side, [Bb, 1 + T])."""
    return _rows_to_host(emitted[:rows].tolist())


def _to_host(accepted: torch.Tensor, tokens: torch.Tensor) -> SampleResult:
    """One device-to-host copy for both: [B, 1 + T] -> per-row accepted count and emitted tokens."""
    return _rows_to_host(torch.cat([accepted.view(-1, 1), tokens], dim=1).tolist())


def _rows_to_host(host: list[list[int]]) -> SampleResult:
    return SampleResult([row[0] for row in host], [row[1: row[0] + 2] for row in host])


def sample_isolating_rows(
    logits: torch.Tensor,
    drafts: torch.Tensor | None,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: list[History] | None,
    is_fatal: Callable[[BaseException], bool],
    best: torch.Tensor | None = None,
) -> tuple[SampleResult, dict[int, BaseException]]:
    """`sample_with_drafts`, but a failure caused by one row's parameters or history fails that row only.

    When the batch fails (and `is_fatal` says the device is fine), every row is sampled alone; a row that
    fails alone is returned in the dict (row index -> its error) with greedy stand-in tokens, so a draft
    round can still run over the whole batch. The caller ends those requests. Each row is sampled alone with the
    draws its generator had before the batch was tried, so a seeded request beside a failing one gets the tokens
    it would get without it.
    """
    # the batch draws every row's uniforms before it can fail (a row's logits found NaN come back with its tokens)
    states = [g.get_state() for g in generators] if any(p.temperature > 0 for p in params) else None
    try:
        return sample_with_drafts(logits, drafts, params, generators, histories, best), {}
    except Exception as exc:  # noqa: BLE001 - sorted out row by row below
        if is_fatal(exc):
            raise
    for generator, state in zip(generators, states or ()):
        generator.set_state(state)
    result = SampleResult([], [], [])
    failed: dict[int, BaseException] = {}
    for i, p in enumerate(params):
        row_drafts = None if drafts is None else drafts[i:i + 1]
        try:
            one = sample_with_drafts(logits[i:i + 1], row_drafts, [p], [generators[i]],
                                     None if histories is None else [histories[i]])
        except Exception as exc:  # noqa: BLE001 - this row's own fault
            if is_fatal(exc):
                raise
            failed[i] = exc
            one = sample_with_drafts(logits[i:i + 1], row_drafts, [SamplingParams(temperature=0.0)], [generators[i]],
                                     check_finite=False)
        result.accepted += one.accepted
        result.tokens += one.tokens
        result.logprobs.append(one.logprobs[0] if one.logprobs else None)
    if not any(result.logprobs):
        result.logprobs = None
    return result, failed
