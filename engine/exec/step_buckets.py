"""The shapes a step is padded to: batch buckets, length buckets (the "span" of keys a forward reads) and prompt
chunk buckets, so that every forward has static shapes and a few captured graphs serve every batch and length.

StepBuckets is ModelRunner's base (engine.exec.runner): the runner pads each forward to these buckets, and the
drafter, the plan executor and CAPTURE_ALL ask it for them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

MIN_SPAN_TOKENS = 256
GROUP_SPAN_RATIO = 8  # rows of one decode forward: length buckets within this factor of the shortest
MIN_CHUNK_TOKENS = 16
# A prompt chunk on the reference path reads every key of its span, so its span is its end rounded up to an
# eighth of the end's power-of-two bucket (at most 12.5 % more keys): with the power of two alone a chunk just
# past 8K of a 16K context read all 16K keys, and cost five times the chunk before it.
CHUNK_SPAN_STEPS = 8


def pow2_bucket(n: int, lower: int = 1) -> int:
    """Smallest power of two >= max(n, lower)."""
    b = lower
    while b < n:
        b *= 2
    return b


class StepBuckets:
    """The bucket methods; what they read is the runner's own (ModelRunner.__init__ sets it)."""

    device: torch.device
    context_tokens: int
    num_slots: int
    lookahead_tokens: int
    kv: Any  # engine.exec.kv.cache.SlotKVCache (exec's base floor imports no kv/): its paging splits groups
    paged_enabled: Callable[[], bool]

    def batch_bucket(self, n: int) -> int:
        return pow2_bucket(n)

    def span_bucket(self, end_tokens: int) -> int:
        """The length bucket for keys [0, end_tokens): a power of two, capped at the context."""
        return min(pow2_bucket(end_tokens, MIN_SPAN_TOKENS), self.context_tokens)

    def chunk_span(self, end_tokens: int) -> int:
        """The key span of a prompt chunk ending at `end_tokens`. On CUDA the chunk kernels (fused causal
        attention, the prefill kernel) read only each query's causal keys, so the span only names the graph: the
        length bucket. Elsewhere the reference reads the whole span: the end rounded up to a fine bucket."""
        if torch.device(self.device).type == "cuda":
            return self.span_bucket(end_tokens)
        step = max(MIN_SPAN_TOKENS, pow2_bucket(end_tokens, MIN_SPAN_TOKENS) // CHUNK_SPAN_STEPS)
        return min(-(-end_tokens // step) * step, self.context_tokens)

    def chunk_spans(self) -> list[int]:
        """Every span chunk_span can give (CAPTURE_ALL)."""
        if torch.device(self.device).type == "cuda":
            return self.span_buckets()
        return sorted({self.chunk_span(end) for end in range(MIN_SPAN_TOKENS, self.context_tokens + MIN_SPAN_TOKENS,
                                                               MIN_SPAN_TOKENS)})

    def step_span(self, end_tokens: int) -> int:
        """The key span a few-query step (decode, verify, a draft round or chain step) is built for. On the paged
        kernels' path each row reads and splits only its own keys, whatever the span: one span, the context, so
        one graph per batch bucket serves every length (no capture, and no kernel compiled, as the slots' contexts
        grow). Elsewhere the reference reads up to the span: the length bucket."""
        return self.context_tokens if self.paged_enabled() else self.span_bucket(end_tokens)

    def step_spans(self) -> list[int]:
        """Every span step_span can give on the current path (CAPTURE_ALL)."""
        return [self.context_tokens] if self.paged_enabled() else self.span_buckets()

    def span_groups(self, end_tokens: list[int], fit_pool: bool = True) -> list[list[int]]:
        """Indices of rows to batch together: rows whose length buckets are within GROUP_SPAN_RATIO of the
        group's shortest. One long slot then costs its own forward (one more read of the weights) instead of
        every short slot reading (and copying) keys up to the long slot's bucket, or, on the paged kernels'
        path, instead of the long slot's keys streaming through as few splits as a full batch gives a row."""
        order = sorted(range(len(end_tokens)), key=lambda i: end_tokens[i])
        groups: list[list[int]] = []
        first_span = 0
        for i in order:
            span = self.span_bucket(end_tokens[i])
            if not groups or span > GROUP_SPAN_RATIO * first_span:
                groups.append([])
                first_span = span
            groups[-1].append(i)
        # KV by use: a forward's slots must fit the shared pool together (unless the caller picked rows that do)
        if self.kv.paging is not None and fit_pool:
            groups = self.kv.paging.split_groups(groups, [e + self.lookahead_tokens for e in end_tokens])
        return groups

    def batch_buckets(self) -> list[int]:
        """Every batch bucket a decode/verify can take: 1, 2, 4, ... up to the bucket of all slots."""
        return _pow2_range(1, self.batch_bucket(self.num_slots))

    def span_buckets(self) -> list[int]:
        """Every length bucket a step can take: powers of two from MIN_SPAN_TOKENS, the last capped at the
        context. Logarithmic in the context (11 buckets for 256K), so capturing all of them stays bounded."""
        spans = [MIN_SPAN_TOKENS]
        while spans[-1] < self.context_tokens:
            spans.append(spans[-1] * 2)
        return sorted({self.span_bucket(s) for s in spans})


def _pow2_range(lower: int, upper: int) -> list[int]:
    """Powers of two times `lower`, from `lower` up to and including `upper`."""
    out, b = [], lower
    while b <= upper:
        out.append(b)
        b *= 2
    return out
