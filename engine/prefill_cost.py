"""The prefill cost model the engine's `SlotEvent.eta_s` and strata-tui's ETA share. Pure Python.

A prompt token at position p attends to the p keys before it, so it costs about `a + b·p` seconds, and the
positions [x0, x1) cost `a·(x1 - x0) + b/2·(x1² - x0²)`. Both sides fit a and b to the chunks that ran and
integrate the rest of the prompt, so the number the engine sends and the one the TUI counts down agree.

Beside decoding slots a chunk's wall time is more than its own cost: decode steps run between the chunks (or
beside them on a side stream), which the fit takes in as part of each token's cost (the pacer keeps their
share steady). But the first chunks beside decodes also pay one-time costs: a kernel compiled or a graph
captured for each new chunk size the pacer picks, the wait before the first chunk ran. Fitted as if every
chunk paid them, they are spread over the rest of the prompt and the ETA comes out too long; `fit_chunks`
fits the curve again without the chunks far over it, and without those far under it (a lull in the device's
other work, on a shared CPU), which would set the slope as much.
"""

from __future__ import annotations

ONE_TIME_COST_RATIO = 2.0  # a chunk that took this many times the fit's prediction paid a one-time cost
LULL_RATIO = 2.0  # a chunk that took under the prediction over this ran in a lull of the device's other work
MIN_USUAL_CHUNKS = 2  # the refit without such chunks needs at least this many others


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


def fit_chunks(chunks: list[tuple[int, int, float]]) -> tuple[float, float] | None:
    """(a s/token, b s/token²) fitted to the chunks that ran, each (x0, x1, seconds); None without one.

    A chunk that took more than ONE_TIME_COST_RATIO times the fit's prediction paid a one-time cost (a kernel
    compiled or a graph captured for a new chunk size beside the decoding slots, the wait before the first chunk
    ran): the curve is fitted again without such chunks (but the latest), so their cost is not spread over the
    rest of the prompt. So is a chunk that took under 1/LULL_RATIO of it: on a shared CPU one chunk ran while the
    other work paused (0.4-1.4 ms a token between chunks of 4-30 ms beside four decoding slots), and fitted, the lull
    set the slope (the ETA at halfway came out 61 % short on such a recorded run, 17 % without it)."""
    chunks = [(x0, x1, dt) for x0, x1, dt in chunks if x1 > x0 and dt >= 0]
    if not chunks:
        return None
    a, b = _fit(chunks)
    # The latest chunk stays whatever it took: it is the best word on the pace now (a step up in cost starts
    # there), and a one-time cost it paid is left out once later chunks show it was one.
    usual = [c for c in chunks[:-1] if _usual(c, span_cost_s(a, b, c[0], c[1]))] + chunks[-1:]
    if MIN_USUAL_CHUNKS <= len(usual) < len(chunks):
        a, b = _fit(usual)
    return a, b


def _usual(chunk: tuple[int, int, float], predicted_s: float) -> bool:
    """Neither a one-time cost nor a lull: the chunk's seconds within the ratios of the fit's prediction."""
    return predicted_s / LULL_RATIO <= chunk[2] <= ONE_TIME_COST_RATIO * predicted_s


def _fit(chunks: list[tuple[int, int, float]]) -> tuple[float, float]:
    return fit_nonnegative([(float(x1 - x0), (x1 * x1 - x0 * x0) / 2.0, dt) for x0, x1, dt in chunks])
