"""The prefill cost model the engine's `SlotEvent.eta_s` and strata-tui's ETA share. Pure Python.

A prompt token at position p attends to the p keys before it, so it costs about `a + b·p` seconds, and the
positions [x0, x1) cost `a·(x1 - x0) + b/2·(x1² - x0²)`. Both sides fit a and b to the chunks that ran and
integrate the rest of the prompt, so the number the engine sends and the one the TUI counts down agree.
"""

from __future__ import annotations


def span_cost_s(a: float, b: float, x0: int, x1: int) -> float:
    """Seconds for prompt positions [x0, x1) under the model (a s/token, b s/token²)."""
    if x1 <= x0:
        return 0.0
    return a * (x1 - x0) + b / 2.0 * (x1 * x1 - x0 * x0)


def fit_nonnegative(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares for dt = a·u + b·v with a, b >= 0 over rows (u, v, dt), in closed form (u = dx,
    v = d(x²/2)).

    Unweighted (absolute seconds): the latest, longest chunks count most, and they are what the rest of the
    prompt resembles (weighting by relative error let the cheap first chunks set the slope, and the ETA came out
    a third short on a CPU engine). With one chunk (or chunks that cannot tell a from b) one term is fitted,
    whichever fits better (b = 0 is the constant rate)."""
    s11 = s12 = s22 = r1 = r2 = 0.0
    for u, v, dt in rows:
        s11 += u * u
        s12 += u * v
        s22 += v * v
        r1 += u * dt
        r2 += v * dt
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-300):
        a = (r1 * s22 - r2 * s12) / det
        b = (s11 * r2 - s12 * r1) / det
        if a >= 0 and b >= 0:
            return a, b
    a_only = r1 / s11 if s11 else 0.0
    b_only = r2 / s22 if s22 else 0.0
    err_a = sum((dt - a_only * u) ** 2 for u, _, dt in rows)
    err_b = sum((dt - b_only * v) ** 2 for _, v, dt in rows)
    return (max(a_only, 0.0), 0.0) if err_a <= err_b else (0.0, max(b_only, 0.0))
