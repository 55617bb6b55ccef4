"""Synthetic routing traces (engine.exec.experts.trace's format) for replaying slot policies offline. Pure Python.

Both kinds draw from one `random.Random(seed)` in a fixed order (step, then layer, then token), so a seed
gives the same trace on every machine. Each step is one decode step of `batch` tokens; an access is the
sorted distinct experts that the step's tokens were routed to in one layer (what the live cache records).

- `uniform`: every token takes `top_k` distinct experts uniformly at random (what random weights route like).
- `skewed`: per layer, a popularity order (a seeded permutation of the experts) with Zipf weights
  1 / rank ** `zipf_s`; temporal locality: each of a token's previous experts in that layer is kept with
  probability `locality`, the rest are drawn by popularity (distinct, without replacement); drift: every
  `request_steps` steps a new "request" starts, which re-shuffles a `drift` share of each layer's popularity
  ranks among themselves and forgets the previous tokens.
"""

from __future__ import annotations

import random

from engine.exec.experts.trace import Access

TRACE_KINDS = ("uniform", "skewed")


def synthetic_trace(kind: str, layers: int, experts: int, top_k: int, steps: int, batch: int = 1, seed: int = 0,
                    zipf_s: float = 1.0, locality: float = 0.3, request_steps: int = 256,
                    drift: float = 0.25) -> list[Access]:
    """The accesses of `steps` decode steps (see the module docstring); raises ValueError on a bad shape."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"trace kind {kind!r}: expected one of {', '.join(TRACE_KINDS)}")
    if not 0 < top_k <= experts or min(layers, steps, batch, request_steps) <= 0:
        raise ValueError(f"bad trace shape: layers={layers} experts={experts} top_k={top_k} steps={steps} "
                         f"batch={batch} request_steps={request_steps}")
    rng = random.Random(seed)
    order = [rng.sample(range(experts), experts) for _ in range(layers)]  # popularity rank -> expert
    rank_weight = [1.0 / (r + 1) ** zipf_s for r in range(experts)]
    prev: list[list[list[int]]] = [[[] for _ in range(batch)] for _ in range(layers)]
    out: list[Access] = []
    for step in range(steps):
        if kind == "skewed" and step and step % request_steps == 0:
            for layer in range(layers):
                _reshuffle(rng, order[layer], drift)
                prev[layer] = [[] for _ in range(batch)]
        for layer in range(layers):
            routed: set[int] = set()
            for b in range(batch):
                if kind == "uniform":
                    chosen = rng.sample(range(experts), top_k)
                else:
                    chosen = _skewed_token(rng, order[layer], rank_weight, prev[layer][b], top_k, locality)
                    prev[layer][b] = chosen
                routed.update(chosen)
            out.append(Access(step, layer, tuple(sorted(routed)), batch, "decode"))
    return out


def _skewed_token(rng: random.Random, order: list[int], rank_weight: list[float], previous: list[int], top_k: int,
                  locality: float) -> list[int]:
    chosen = [e for e in previous if rng.random() < locality]
    taken = set(chosen)
    while len(chosen) < top_k:
        e = order[rng.choices(range(len(order)), weights=rank_weight)[0]]
        if e not in taken:
            taken.add(e)
            chosen.append(e)
    return chosen


def _reshuffle(rng: random.Random, order: list[int], share: float) -> None:
    """Shuffle a random `share` of the ranks among themselves (in place)."""
    ranks = rng.sample(range(len(order)), round(len(order) * share))
    moved = [order[r] for r in ranks]
    rng.shuffle(moved)
    for r, e in zip(ranks, moved):
        order[r] = e
