"""Plausibility checks of measured costs: what a calibration (or a live refit) may not claim.

A start-up calibration on a busy machine can come out physically impossible: one stall on
every size, and the non-negative least squares puts it all in the fixed cost (seen:
``prefill 81.84ms + 0.00us/token``). A prefill that costs nothing per token makes every
recompute look as cheap as the shortest one, so no load ever wins. These checks name what
is wrong (one line) so the caller can measure again or fall back to a prior:

- ``check_prefill(cost, samples)``: coefficients finite and >= 0; every sample under
  ``MAX_SAMPLE_S``; at the longest sample, a per-token cost in
  [``MIN_PER_TOKEN_S``, ``MAX_PER_TOKEN_S``] that makes up at least ``MIN_VARIABLE_SHARE`` of
  the prediction (a prefill that does not grow with its length is noise, not a model);
  a fixed cost under ``MAX_FIXED_S``; relative residuals (root mean square) under
  ``max_rms``.
- ``check_tier(cost)``: latency under ``MAX_LATENCY_S`` and bandwidth in
  [``MIN_BANDWIDTH``, ``MAX_BANDWIDTH``].

Pure functions; return None when the values are plausible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cachestore.cost.model import PrefillCost, PrefillSample, TierCost

MIN_PER_TOKEN_S = 1e-9  # 1 ns a token: below any real model, even a tiny one on an H200
MAX_PER_TOKEN_S = 0.1
MAX_FIXED_S = 2.0
MAX_SAMPLE_S = 60.0
# The part of the longest calibrated prefill that depends on its length. Real fits: the
# 8B on an H200 ~97% at 4K tokens, the demo model on 2 CPU cores ~70% at 256.
MIN_VARIABLE_SHARE = 0.1
MAX_RMS_RELATIVE = 0.5  # root mean square of (fit - t) / t over the samples
MAX_LATENCY_S = 1.0
MIN_BANDWIDTH = 1e6  # 1 MB/s
MAX_BANDWIDTH = 1e13  # 10 TB/s


def check_prefill(
    cost: PrefillCost, samples: Sequence[PrefillSample], *, max_rms: float = MAX_RMS_RELATIVE
) -> str | None:
    """Why ``cost``, fitted to ``samples``, is implausible (one line), or None."""
    coefs = (cost.fixed_s, cost.per_token_s, cost.attention_s)
    if not all(math.isfinite(x) and x >= 0 for x in coefs):
        return f"coefficients must be finite and >= 0, got {coefs}"
    if not samples:
        return "no samples"
    slow = max(samples, key=lambda s: s.seconds)
    if not slow.seconds <= MAX_SAMPLE_S:
        return (
            f"a prefill of {slow.num_tokens} tokens took {slow.seconds:.1f} s "
            f"(over {MAX_SAMPLE_S:.0f} s)"
        )
    longest = max(samples, key=lambda s: (s.num_tokens, s.context_tokens))
    n, c = longest.num_tokens, longest.context_tokens
    total = cost.time(n, c)
    per_token = (total - cost.fixed_s) / n if n else 0.0
    if not per_token >= MIN_PER_TOKEN_S:
        return (
            f"zero per-token cost ({per_token * 1e6:.3f} us/token at {n} tokens): a "
            f"prefill must grow with its length"
        )
    if per_token > MAX_PER_TOKEN_S:
        return f"per-token cost {per_token * 1e3:.1f} ms is over {MAX_PER_TOKEN_S * 1e3:.0f} ms"
    if cost.fixed_s > MAX_FIXED_S:
        return f"fixed cost {cost.fixed_s:.2f} s is over {MAX_FIXED_S:.0f} s"
    if total - cost.fixed_s < MIN_VARIABLE_SHARE * total:
        return (
            f"flat fit: the fixed {cost.fixed_s * 1e3:.2f} ms is "
            f"{cost.fixed_s / total:.0%} of a {n}-token prefill"
        )
    rms = relative_rms(cost, samples)
    if rms > max_rms:
        return f"residuals too large: {rms:.0%} root-mean-square relative error"
    return None


def relative_rms(
    cost: PrefillCost, samples: Sequence[PrefillSample], weights: Sequence[float] | None = None
) -> float:
    """Root mean square of ``(cost(n, c) - t) / t`` over ``samples`` (weighted when given);
    samples with ``t <= 0`` do not count. 0 for none."""
    w = weights if weights is not None else [1.0] * len(samples)
    num = den = 0.0
    for s, wi in zip(samples, w, strict=True):
        if s.seconds > 0:
            num += wi * ((cost.time(s.num_tokens, s.context_tokens) - s.seconds) / s.seconds) ** 2
            den += wi
    return math.sqrt(num / den) if den > 0 else 0.0


def check_tier(cost: TierCost) -> str | None:
    """Why a measured tier cost is implausible (one line), or None."""
    if not (math.isfinite(cost.latency_s) and cost.latency_s <= MAX_LATENCY_S):
        return f"tier {cost.name!r}: latency {cost.latency_s:.3f} s is over {MAX_LATENCY_S:.0f} s"
    bw = cost.bandwidth_bytes_per_s
    if not (math.isfinite(bw) and MIN_BANDWIDTH <= bw <= MAX_BANDWIDTH):
        return (
            f"tier {cost.name!r}: bandwidth {bw / 1e9:.4g} GB/s is outside "
            f"[{MIN_BANDWIDTH / 1e9:g}, {MAX_BANDWIDTH / 1e9:g}] GB/s"
        )
    return None
