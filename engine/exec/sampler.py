"""Sampling: temperature, top-p, per-request seeded generators, and speculative acceptance of MTP drafts.

One function serves plain decode and MTP verify: `sample_with_drafts(logits [B, T, V], drafts [B, T-1])`.
Drafts are proposed greedily (argmax of the MTP head), i.e. from a one-hot draft distribution q, so standard
speculative rejection sampling reduces to: accept draft d at position j with probability p_j(d); at the first
rejection sample from p_j with d removed (the residual max(0, p - q), renormalized); if all K are accepted,
sample the bonus token from p_K. Greedy rows use p = one-hot(argmax), which turns the same rule into "accept
while the draft equals the argmax" -- so the output is token-for-token what plain greedy decoding gives.

Random numbers come from per-request CPU generators (seeded: reproducible on any device); only the small
uniform draws travel to the device, and only [B, T] token ids come back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.api import GREEDY_BELOW_TEMPERATURE, SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded when the request gave a seed, otherwise from entropy."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


@dataclass
class SampleResult:
    """Per row: how many drafts were accepted and the tokens to emit (accepted drafts, then one more)."""

    accepted: list[int]
    tokens: list[list[int]]


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 use_top_p: bool | None = None) -> torch.Tensor:
    """Sampling distribution per row and position: logits [B, T, V] -> probs [B, T, V] (float32).

    temperature 0 gives one-hot(argmax); top_p < 1 keeps the smallest set whose mass reaches top_p. `use_top_p`
    None reads whether any row truncates from top_p (a host sync); device code passes it.
    """
    logits = logits.float()
    # Below GREEDY_BELOW_TEMPERATURE logits / t overflows to inf (NaN probabilities): such rows are greedy.
    sampled = temperature >= GREEDY_BELOW_TEMPERATURE
    greedy = (~sampled).view(-1, 1, 1)
    safe_t = torch.where(sampled, temperature, torch.ones_like(temperature)).view(-1, 1, 1)
    probs = torch.softmax(logits / safe_t, dim=-1)
    if use_top_p is None:
        use_top_p = bool((top_p < 1.0).any())
    if use_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        keep = before < top_p.view(-1, 1, 1)
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
    static flag (whether any row truncates), so device code that takes these never reads a value on the host."""

    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    uniforms: torch.Tensor  # [B, 2T] float32
    use_top_p: bool


def sampling_inputs(params: list[SamplingParams], generators: list[torch.Generator], positions: int,
                    device: torch.device | str, rows: int | None = None) -> SamplingInputs:
    """Draw each request's uniforms (in request order, from its own generator) and pack the per-row parameters.

    `rows` pads to a batch bucket (padding rows: greedy, no draws)."""
    rows = len(params) if rows is None else rows
    pad = rows - len(params)
    temperature = [p.temperature for p in params] + [0.0] * pad
    top_p = [p.top_p for p in params] + [1.0] * pad
    u = torch.stack([torch.rand(2 * positions, generator=g) for g in generators]
                    + [torch.zeros(2 * positions)] * pad)
    host = torch.cat([torch.tensor([temperature, top_p], dtype=torch.float32).T, u], dim=1)  # one copy over
    packed = host.to(device)
    return SamplingInputs(packed[:, 0], packed[:, 1], packed[:, 2:], any(p.top_p < 1.0 for p in params))


def sample_on_device(logits: torch.Tensor, drafts: torch.Tensor | None, temperature: torch.Tensor,
                     top_p: torch.Tensor, uniforms: torch.Tensor, use_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling math on the device: logits [B, T, V], drafts [B, T-1] or None -> (accepted [B], tokens
    [B, T]); a row emits tokens[:accepted + 1]. No host reads: it runs inside a captured graph too."""
    b, t, _ = logits.shape
    k = t - 1
    device = logits.device
    probs = target_probs(logits, temperature, top_p, use_top_p)  # [B, T, V]
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
) -> SampleResult:
    """Sample the next token(s) of B rows. logits [B, T, V]; drafts [B, T-1] long on the same device, or None.

    Rows beyond len(params) are batch padding and are ignored.
    """
    rows = len(params)
    logits = logits[:rows]
    if all(p.temperature <= 0 for p in params):
        return _greedy(logits, None if drafts is None else drafts[:rows])
    inputs = sampling_inputs(params, generators, logits.shape[1], logits.device)
    accepted, tokens = sample_on_device(logits, None if drafts is None else drafts[:rows], inputs.temperature,
                                        inputs.top_p, inputs.uniforms, inputs.use_top_p)
    return _to_host(accepted, tokens)


def _greedy(logits: torch.Tensor, drafts: torch.Tensor | None) -> SampleResult:
    """All rows greedy: the argmax at each position; drafts are accepted while they equal it. Same result as
    the general path with one-hot distributions, in a handful of kernels (the common serving case)."""
    best = logits.argmax(dim=-1)  # [B, T]
    k = best.shape[1] - 1
    if k > 0 and drafts is not None:
        accepted = (best[:, :k] == drafts).long().cumprod(dim=-1).sum(dim=-1)
        return _to_host(accepted, best)  # accepted drafts equal the argmax, so the row is the emitted tokens
    # Plain decode: no acceptance to count, and no kernels spent on one (every launch shows on a small model).
    rows = best[:, :1].tolist()
    return SampleResult([0] * len(rows), rows)


def device_result(accepted: torch.Tensor, tokens: torch.Tensor, rows: int) -> SampleResult:
    """The first `rows` rows of a verify sampled on the device (MtpDrafter.verify_and_draft)."""
    return _to_host(accepted[:rows], tokens[:rows])


def _to_host(accepted: torch.Tensor, tokens: torch.Tensor) -> SampleResult:
    """One device-to-host copy for both: [B, 1 + T] -> per-row accepted count and emitted tokens."""
    host = torch.cat([accepted.view(-1, 1), tokens], dim=1).tolist()
    return SampleResult([row[0] for row in host], [row[1: row[0] + 2] for row in host])
