"""The prefill fit shared by start-up calibration and the online learner.

``fit_prefill_nonnegative`` is a (weighted) least squares of the prefill model with
non-negative coefficients. Pure, torch-free, no numpy (three unknowns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations

from cachestore.cost.model import PrefillCost, PrefillSample


def fit_prefill_nonnegative(
    samples: Sequence[PrefillSample],
    *,
    relative: bool = False,
    weights: Sequence[float] | None = None,
) -> PrefillCost:
    """Least squares of ``t = a + b*n + c2*n*(c + n/2)`` with ``a, b, c2 >= 0``: the best of
    every subset of free coefficients whose solution is non-negative (3 unknowns: 7 subsets).
    Noise must not make a long prompt look free. ``relative``: minimise the relative errors
    ``(fit - t) / t`` instead of the absolute ones, so that short prefills, seconds apart from
    long ones, are fitted as well as they (when a decision compares both). ``weights``: one
    weight >= 0 per sample on its squared error (None: all 1). Raises ValueError with fewer
    than 3 samples, weights that do not match them or, when ``relative``, a time <= 0."""
    if len(samples) < 3:
        raise ValueError("need at least 3 prefill samples")
    if relative and any(not s.seconds > 0 for s in samples):
        raise ValueError("a relative fit needs every prefill time > 0")
    w = [1.0] * len(samples) if weights is None else list(weights)
    if len(w) != len(samples) or any(not x >= 0 for x in w):
        raise ValueError(f"need one weight >= 0 per sample, got {len(w)} for {len(samples)}")
    rows = [
        (1.0, float(s.num_tokens), s.num_tokens * (s.context_tokens + s.num_tokens / 2))
        for s in samples
    ]
    ys = [s.seconds for s in samples]
    if relative:  # each equation divided by its own time: residuals become relative errors
        rows = [(r[0] / y, r[1] / y, r[2] / y) for r, y in zip(rows, ys, strict=True)]
        ys = [1.0] * len(ys)
    if weights is not None:  # a weight on a squared error is its root on the equation
        roots = [math.sqrt(x) for x in w]
        rows = [(r[0] * k, r[1] * k, r[2] * k) for r, k in zip(rows, roots, strict=True)]
        ys = [y * k for y, k in zip(ys, roots, strict=True)]
    # The normal equations once; each subset solves its part of them, and its squared error
    # is the quadratic form y'y - 2 x'X'y + x'X'X x (no pass over the samples per subset).
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]
    yty = sum(y * y for y in ys)
    best: tuple[float, list[float]] | None = None
    for k in (3, 2, 1):
        for active in combinations(range(3), k):
            coef = _solve([[ata[i][j] for j in active] + [aty[i]] for i in active])
            if coef is None or min(coef) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for i, x in zip(active, coef, strict=True):
                full[i] = x
            sse = (
                yty
                - 2 * sum(f * b for f, b in zip(full, aty, strict=True))
                + sum(full[i] * ata[i][j] * full[j] for i in range(3) for j in range(3))
            )
            if best is None or sse < best[0]:
                best = (sse, full)
    if best is None:  # only when every weight is 0: nothing to fit
        raise ValueError("prefill samples carry no weight")
    return PrefillCost(*best[1])


def _solve(m: list[list[float]]) -> list[float] | None:
    """Gauss-Jordan with pivoting on the augmented ``k x (k+1)`` matrix ``m`` (modified);
    None when singular."""
    k = len(m)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * z for x, z in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]
