"""The online prefill model: a calibrated curve, a learned scale, and refits of its shape.

``PrefillLearner`` predicts ``scale * base(n, c)`` (``base`` a ``PrefillCost``). Each live
prefill sample ``(n, c, t)``:

1. moves the scale by an EWMA with weight ``alpha``: ``scale += alpha * (t / base - scale)``.
   A scale corrects the magnitude (another clock, another backend) but never the shape: a
   base with no per-token cost stays flat whatever it learns.
2. joins a window of the last ``window`` samples. Once the window spans different lengths
   (the longest at least ``SPREAD`` times the shortest, ``MIN_REFIT_SAMPLES`` samples), an
   exponentially weighted least squares over it (weight ``(1 - alpha) ** age``, relative
   errors, non-negative coefficients: ``fit_prefill_nonnegative``) is a candidate shape. It
   replaces ``scale * base`` (scale back to 1) when it passes ``check_prefill`` and either
   the model is not trusted yet (the refit replaces the curve) or the current curve misses
   the window by more than ``SHAPE_TOLERANCE`` and twice the refit's own error (the curve
   moves toward the refit by ``1 - (1 - alpha) ** len(window)``, what the window's samples
   weigh in the EWMA). So a wrong slope, zero included, is corrected within a few requests
   of different lengths.

``trusted``: the base passed its checks at calibration, or a refit from live samples has
replaced it since. Until then ``OnlineCostModel.decide`` loads whatever a tier holds.

Not thread-safe: ``OnlineCostModel`` calls it under its lock. Torch-free, no I/O.
"""

from __future__ import annotations

from collections import deque

from cachestore.cost.checks import check_prefill, relative_rms
from cachestore.cost.fit import fit_prefill_nonnegative
from cachestore.cost.model import PrefillCost, PrefillSample

MIN_REFIT_SAMPLES = 3
SPREAD = 1.5  # longest / shortest new-token count in the window before a refit is tried
SHAPE_TOLERANCE = 0.1  # relative RMS error of the current curve that a refit may correct
WINDOW = 16
# While trusted, a refit is tried on every this many samples only: a refit costs ~0.2 ms
# of Python, and a trusted curve is rarely wrong.
TRUSTED_REFIT_EVERY = 16


class PrefillLearner:
    """See the module docstring. ``num_samples`` counts the samples used."""

    def __init__(
        self, base: PrefillCost, alpha: float, *, trusted: bool = True, window: int = WINDOW
    ) -> None:
        self.base = base
        self.scale = 1.0
        self.alpha = alpha
        self.trusted = trusted
        self.num_samples = 0
        self.num_refits = 0
        self._window: deque[PrefillSample] = deque(maxlen=window)

    def cost(self) -> PrefillCost:
        """The current prediction: ``scale * base``."""
        return scaled(self.base, self.scale)

    def observe(self, num_tokens: int, context_tokens: int, seconds: float) -> bool:
        """Learn from one prefill; False when the sample carries no information
        (``seconds <= 0``, no token)."""
        if not seconds > 0 or num_tokens <= 0:
            return False
        self._window.append(PrefillSample(num_tokens, context_tokens, seconds))
        base = self.base.time(num_tokens, context_tokens)
        if base > 0:
            self.scale += self.alpha * (seconds / base - self.scale)
        self.num_samples += 1
        if not self.trusted or self.num_samples % TRUSTED_REFIT_EVERY == 0:
            self._maybe_refit()
        return True

    def _maybe_refit(self) -> None:
        samples = list(self._window)
        lengths = [s.num_tokens for s in samples]
        if len(samples) < MIN_REFIT_SAMPLES or max(lengths) < SPREAD * min(lengths):
            return  # one length cannot separate the fixed cost from the per-token one
        weights = [(1.0 - self.alpha) ** age for age in range(len(samples) - 1, -1, -1)]
        fit = fit_prefill_nonnegative(samples, relative=True, weights=weights)
        if check_prefill(fit, samples) is not None:
            return  # the window is too noisy to say better: keep learning
        current = relative_rms(self.cost(), samples, weights)
        refit = relative_rms(fit, samples, weights)
        if self.trusted and current <= max(SHAPE_TOLERANCE, 2.0 * refit):
            return
        # The window's evidence weighs what its samples would in the EWMA (all of it for an
        # untrusted curve): a model frozen with alpha ~ 0 keeps its curve.
        w = 1.0 if not self.trusted else 1.0 - (1.0 - self.alpha) ** len(samples)
        cur = self.cost()
        self.base = PrefillCost(
            *(
                c + w * (f - c)
                for c, f in (
                    (cur.fixed_s, fit.fixed_s),
                    (cur.per_token_s, fit.per_token_s),
                    (cur.attention_s, fit.attention_s),
                )
            )
        )
        self.scale, self.trusted = 1.0, True
        self.num_refits += 1


def scaled(p: PrefillCost, scale: float) -> PrefillCost:
    """``p`` with every coefficient times ``scale`` (``p`` itself for 1)."""
    if scale == 1.0:
        return p
    return PrefillCost(p.fixed_s * scale, p.per_token_s * scale, p.attention_s * scale)
