"""The prefill chunk cost model the pacer (engine.core.prefill_pacer) sizes chunks by. Pure Python.

    cost_s(tokens, start) = a + b * tokens + c * tokens * (start + (tokens + 1) / 2) + d * (start + tokens)

A fixed cost, the per-token layers, attention over the keys a query sees (start + (tokens + 1) / 2 on average),
and the keys a chunk reads once whatever its size (on a GPU the flash kernel streams the whole span per query
block, and int8 KV is dequantized over it), fitted to the recent chunks the engine measured (`ChunkTiming`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from engine.errors import ConfigError

_COST_WINDOW_CHUNKS = 32
_PRIOR_WEIGHT = 1e-5  # per coefficient, in measured chunks: settles only what the chunks cannot tell apart at all
# (1e-3 biased the four-term fit by 40 % on exact data: the terms are close to collinear in relative error)


@dataclass(frozen=True)
class ChunkCost:
    """Coefficients of cost_s = fixed_s + per_token_s * tokens + per_token_key_s * tokens * mean_keys
    + per_key_s * (start + tokens)."""

    fixed_s: float
    per_token_s: float
    per_token_key_s: float
    per_key_s: float = 0.0

    def terms_s(self, tokens: int, start: int) -> tuple[float, float, float, float]:
        """The four terms of the cost of prompt positions [start, start + tokens), in seconds."""
        mean_keys = start + (tokens + 1) / 2
        return (self.fixed_s, self.per_token_s * tokens, self.per_token_key_s * tokens * mean_keys,
                self.per_key_s * (start + tokens))

    def predict_s(self, tokens: int, start: int) -> float:
        return sum(self.terms_s(tokens, start))


# A slow device on purpose (the prior is conservative: it overestimates, so the first chunks are small):
# 5 ms per chunk, 20K tokens/s, attention as costly as the other layers at 8K keys, 50 ns per key of the span
# read once per chunk. The first measured chunk rescales it; its shape only matters where the measurements
# cannot tell the terms apart.
DEFAULT_CHUNK_COST_PRIOR = ChunkCost(fixed_s=5e-3, per_token_s=50e-6, per_token_key_s=50e-6 / 8192, per_key_s=50e-9)


@dataclass(frozen=True)
class ChunkTiming:
    """One prefill chunk as it ran: prompt positions [start, start + num_tokens) took `seconds`."""

    start: int
    num_tokens: int
    seconds: float


class ChunkCostModel:
    """`ChunkCost` fitted to the last chunks: least squares on relative error, pulled toward the prior.

    The prior is first rescaled to the measurements (the median of measured / prior cost), then each coefficient
    is fitted as a multiple of its rescaled prior value, with a ridge pull toward 1. Relative error weighs a
    0.5 ms chunk like a 500 ms one, and a slow outlier (a graph capture) moves the fit by at most one row's worth.
    """

    def __init__(self, prior: ChunkCost = DEFAULT_CHUNK_COST_PRIOR, window_chunks: int = _COST_WINDOW_CHUNKS,
                 prior_weight: float = _PRIOR_WEIGHT) -> None:
        for name, value in (("fixed_s", prior.fixed_s), ("per_token_s", prior.per_token_s),
                            ("per_token_key_s", prior.per_token_key_s)):
            if not value > 0:
                raise ConfigError(f"chunk_cost_prior.{name}", value, "expected a number > 0")
        if not prior.per_key_s >= 0:  # 0: a model without the per-key term (it is then never fitted)
            raise ConfigError("chunk_cost_prior.per_key_s", prior.per_key_s, "expected a number >= 0")
        self.prior = prior
        self.prior_weight = prior_weight
        self._samples: deque[ChunkTiming] = deque(maxlen=window_chunks)
        self._fitted: ChunkCost | None = prior

    def record(self, timing: ChunkTiming) -> None:
        """Add a measured chunk (non-positive times and empty chunks carry no information and are skipped)."""
        if timing.num_tokens > 0 and timing.seconds > 0:
            self._samples.append(timing)
            self._fitted = None

    def coefficients(self) -> ChunkCost:
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def predict_s(self, tokens: int, start: int) -> float:
        return self.coefficients().predict_s(tokens, start)

    def _fit(self) -> ChunkCost:
        rows = [(self.prior.terms_s(s.num_tokens, s.start), s.seconds) for s in self._samples]
        if not rows:
            return self.prior
        scale = statistics.median(y / sum(terms) for terms, y in rows)
        lam = self.prior_weight
        n = 4
        normal = [[lam if i == j else 0.0 for j in range(n)] for i in range(n)]
        rhs = [lam] * n
        for terms, y in rows:
            r = [t * scale / y for t in terms]  # unknown multipliers of the rescaled prior terms; target 1
            for i in range(n):
                rhs[i] += r[i]
                for j in range(n):
                    normal[i][j] += r[i] * r[j]
        mult = [max(0.0, m) for m in _solve(normal, rhs)]
        if not any(mult):
            mult = [1.0] * n
        p = self.prior
        return ChunkCost(p.fixed_s * scale * mult[0], p.per_token_s * scale * mult[1],
                         p.per_token_key_s * scale * mult[2], p.per_key_s * scale * mult[3])


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve the n x n system a x = b by Gaussian elimination with partial pivoting (a is positive definite)."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
