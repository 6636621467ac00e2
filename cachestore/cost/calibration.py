"""Start-up calibration: measure prefill and tier transfers, fit the cost model's priors.

Torch-free: the engine passes callbacks that do the device work.

- ``calibrate_prefill(run_prefill)`` times ``run_prefill(num_tokens, context_tokens)`` (it returns
  seconds) at a few sizes after one warm-up call, keeps the fastest of ``repeats`` runs per size
  and fits ``PrefillCost`` by least squares with non-negative coefficients.
- ``calibrate_copy``, ``calibrate_tier``, ``calibrate_transfer``: one hop timed and fitted
  (``cachestore.cost.transfer``, re-exported here).
- ``calibrate_prefill_checked(...)`` measures until ``cachestore.cost.checks.check_prefill``
  accepts the fit (a bounded number of attempts), else falls back to a prior, untrusted.
- ``calibrate(...)`` runs all of them, checks every measurement (a tier that fails
  ``check_tier`` twice keeps its prior, untrusted) and returns a ready ``OnlineCostModel``.

Progress goes to stderr through tqdm. Safe to run while others use the tiers: it only adds and
removes its own keys (a random prefix), which may evict others' blocks from a full tier.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from cachestore.cost.checks import check_prefill, check_tier
from cachestore.cost.fit import fit_prefill_nonnegative
from cachestore.cost.model import PrefillCost, PrefillSample, TierCost
from cachestore.cost.online import CostPriors, OnlineCostModel
from cachestore.cost.transfer import (
    TransferFit,
    TransferSample,
    calibrate_copy,
    calibrate_tier,
    calibrate_transfer,
    fit_transfer,
)
from tiers.base import Tier

if TYPE_CHECKING:
    from tqdm import tqdm

# Re-exported: their homes are cachestore.cost.fit and cachestore.cost.transfer.
__all__ = [
    "TransferFit",
    "TransferSample",
    "calibrate_copy",
    "calibrate_tier",
    "calibrate_transfer",
    "fit_prefill_nonnegative",
    "fit_transfer",
]
log = logging.getLogger(__name__)
# Measurements of a size are repeated up to this many times when checks reject the fit.
CALIBRATION_ATTEMPTS = 3

# (new tokens, context tokens): lengths and context both vary so all three terms are determined.
DEFAULT_PREFILL_SIZES: tuple[tuple[int, int], ...] = (
    (256, 0),
    (1024, 0),
    (4096, 0),
    (1024, 3072),
    (256, 4096),
)


def _progress(total: int, desc: str, enabled: bool) -> tqdm[Any]:
    from tqdm import tqdm

    # disable=None: tqdm draws only on a terminal, so log files get no carriage-return bars.
    return tqdm(
        total=total, desc=desc, file=sys.stderr, disable=None if enabled else True, leave=False
    )


def calibrate_prefill(
    run_prefill: Callable[[int, int], float],
    sizes: Sequence[tuple[int, int]] = DEFAULT_PREFILL_SIZES,
    *,
    repeats: int = 2,
    progress: bool = True,
    relative: bool = False,
) -> PrefillCost:
    """Fit ``PrefillCost`` to timed prefills. ``run_prefill(n, c)`` prefills ``n`` new tokens
    after ``c`` cached ones and returns the seconds it took. ``relative``: see
    ``fit_prefill_nonnegative``. No plausibility check (``calibrate_prefill_checked``).
    Raises ValueError when ``sizes`` do not determine a fit (fewer than 3 distinct shapes)
    or a run reports no time."""
    samples = sample_prefill(run_prefill, sizes, repeats=repeats, progress=progress)
    return fit_prefill_nonnegative(samples, relative=relative)


def sample_prefill(
    run_prefill: Callable[[int, int], float],
    sizes: Sequence[tuple[int, int]] = DEFAULT_PREFILL_SIZES,
    *,
    repeats: int = 2,
    progress: bool = True,
    warm_up: bool = True,
) -> list[PrefillSample]:
    """Time every size ``repeats`` times after one warm-up call; the fastest run of each
    counts. Raises ValueError as ``calibrate_prefill``."""
    if repeats < 1 or len(set(sizes)) < 3:
        raise ValueError(f"need repeats >= 1 and >= 3 distinct sizes, got {repeats}, {sizes}")
    samples: list[PrefillSample] = []
    with _progress(len(sizes) * repeats + warm_up, "calibrate prefill", progress) as bar:
        if warm_up:
            run_prefill(*min(sizes))  # first-call allocations and kernel compilation
            bar.update(1)
        for n, c in sizes:
            best = float("inf")
            for _ in range(repeats):
                best = min(best, float(run_prefill(n, c)))
                bar.update(1)
            if not best > 0:
                raise ValueError(f"run_prefill({n}, {c}) reported {best} s")
            samples.append(PrefillSample(n, c, best))
    return samples


@dataclass(frozen=True, slots=True)
class PrefillCalibration:
    """A checked prefill calibration: the cost to start from, whether it was measured and
    passed ``check_prefill`` (``trusted``), and why not (``reason``, one line)."""

    cost: PrefillCost
    trusted: bool
    reason: str | None = None


def calibrate_prefill_checked(
    run_prefill: Callable[[int, int], float],
    sizes: Sequence[tuple[int, int]] = DEFAULT_PREFILL_SIZES,
    *,
    fallback: PrefillCost | None = None,
    attempts: int = CALIBRATION_ATTEMPTS,
    repeats: int = 2,
    progress: bool = True,
) -> PrefillCalibration:
    """Measure and fit (relative errors) up to ``attempts`` times until ``check_prefill``
    accepts the fit; each new attempt keeps, per size, the fastest time of every attempt so
    far (a stall in one attempt does not survive the next). When every attempt is rejected:
    ``fallback`` (a prior), else the last fit, untrusted. Each rejection is logged (WARNING).
    Raises ValueError as ``calibrate_prefill``."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    best: dict[tuple[int, int], float] = {}
    fit, reason = None, None
    for attempt in range(attempts):
        for s in sample_prefill(
            run_prefill, sizes, repeats=repeats, progress=progress, warm_up=attempt == 0
        ):
            key = (s.num_tokens, s.context_tokens)
            best[key] = min(best.get(key, float("inf")), s.seconds)
        samples = [PrefillSample(n, c, t) for (n, c), t in best.items()]
        fit = fit_prefill_nonnegative(samples, relative=True)
        reason = check_prefill(fit, samples)
        if reason is None:
            return PrefillCalibration(fit, True)
        log.warning("prefill calibration %d/%d rejected: %s", attempt + 1, attempts, reason)
    assert fit is not None
    if fallback is not None:
        log.warning("prefill calibration: keeping the prior (%s); it is corrected online", reason)
        return PrefillCalibration(fallback, False, reason)
    return PrefillCalibration(fit, False, reason)


def calibrate(
    tiers: Sequence[Tier],
    block_bytes: int,
    block_tokens: int,
    run_prefill: Callable[[int, int], float] | None = None,
    *,
    host_to_gpu: Callable[[int], float] | None = None,
    priors: CostPriors | None = None,
    prefill_sizes: Sequence[tuple[int, int]] = DEFAULT_PREFILL_SIZES,
    num_blocks: int = 32,
    alpha: float = 0.2,
    progress: bool = True,
    tier_block_bytes: int | None = None,
    transfer_timers: Mapping[str, Callable[[int], float]] | None = None,
    transfer_sizes: Sequence[int] = (16, 128),
    tier_readers: int = 1,
) -> OnlineCostModel:
    """Measure what can be measured and start an ``OnlineCostModel`` from it.

    The ``host`` entry is the host -> GPU hop that every load ends with: timed with
    ``host_to_gpu(n)`` when given (whether or not a host tier is in ``tiers``), else by reading
    the host tier if there is one (on a CPU engine that copy is the hop). Every other tier is
    timed with ``calibrate_tier`` on blocks of ``tier_block_bytes`` (default ``block_bytes``;
    pass the encoded size, codec header included, to move what a real load moves), its reads
    split over ``tier_readers`` threads (the load pipeline's readers).
    ``transfer_timers[name](n)``, when given, times tier ``name`` through a whole load path
    instead (``calibrate_transfer`` at ``transfer_sizes``; the fit then prices that path as
    one hop when no ``host`` entry is measured or given). ``run_prefill`` (optional) fits the
    prefill model.
    Whatever is not measured keeps its value from ``priors`` (required then). A tier that fails
    keeps its prior too. Raises ValueError when neither a measurement nor a prior exists."""
    costs: dict[str, TierCost] = dict(priors.tier_costs) if priors is not None else {}
    untrusted: set[str] = set()
    if host_to_gpu is not None:
        _checked(
            lambda: calibrate_copy(host_to_gpu, block_bytes, "host", num_blocks=num_blocks),
            "host",
            costs,
            untrusted,
        )
        tiers = [t for t in tiers if t.name != "host"]
    moved_bytes = tier_block_bytes or block_bytes
    _measure_tiers(tiers, moved_bytes, num_blocks, progress, costs, untrusted, tier_readers)
    for name, timer in (transfer_timers or {}).items():
        _checked_or_prior(
            partial(_transfer_cost, timer, moved_bytes, name, transfer_sizes),
            f"transfer {name!r}",
            name,
            costs,
            untrusted,
        )
    prefill, trusted = _prefill_model(run_prefill, priors, prefill_sizes, progress)
    return OnlineCostModel(
        costs,
        prefill,
        block_bytes,
        block_tokens,
        alpha=alpha,
        prefill_trusted=trusted,
        untrusted_tiers=untrusted,
    )


def _measure_tiers(
    tiers: Sequence[Tier],
    block_bytes: int,
    num_blocks: int,
    progress: bool,
    costs: dict[str, TierCost],
    untrusted: set[str],
    readers: int = 1,
) -> None:
    """``calibrate_tier`` of each tier into ``costs`` (``_checked_or_prior``)."""
    with _progress(len(tiers), "calibrate tiers", progress) as bar:
        for tier in tiers:
            _checked_or_prior(
                partial(calibrate_tier, tier, block_bytes, num_blocks, readers=readers),
                f"tier {tier.name!r}",
                tier.name,
                costs,
                untrusted,
            )
            bar.update(1)


def _prefill_model(
    run_prefill: Callable[[int, int], float] | None,
    priors: CostPriors | None,
    sizes: Sequence[tuple[int, int]],
    progress: bool,
) -> tuple[PrefillCost, bool]:
    """The prefill model ``calibrate`` starts from and whether it is trusted: measured when
    ``run_prefill`` is given (``calibrate_prefill_checked``), else the prior."""
    if run_prefill is not None:
        checked = calibrate_prefill_checked(
            run_prefill,
            sizes,
            fallback=priors.prefill if priors else None,
            progress=progress,
        )
        return checked.cost, checked.trusted
    if priors is not None:
        return priors.prefill, True
    raise ValueError("calibrate needs run_prefill or priors for the prefill model")


def _checked_or_prior(
    measure: Callable[[], TierCost],
    what: str,
    name: str,
    costs: dict[str, TierCost],
    untrusted: set[str],
) -> None:
    """``_checked``; a measurement that fails keeps the prior, and without one raises
    ValueError naming ``what``: a failing tier must not stop the engine from starting."""
    try:
        _checked(measure, name, costs, untrusted)
    except Exception as exc:
        if name not in costs:
            raise ValueError(f"{what}: calibration failed ({exc}) and no prior is given") from exc


def _transfer_cost(
    timer: Callable[[int], float], block_bytes: int, name: str, sizes: Sequence[int]
) -> TierCost:
    return calibrate_transfer(timer, block_bytes, name, sizes=sizes).cost


def _checked(
    measure: Callable[[], TierCost],
    name: str,
    costs: dict[str, TierCost],
    untrusted: set[str],
    attempts: int = 2,
) -> None:
    """``costs[name] = measure()`` once ``check_tier`` accepts it (up to ``attempts``
    measurements). When none passes, the prior (if any, else the last measurement) stays and
    ``name`` joins ``untrusted`` (the online model then learns it faster). A measurement
    that raises propagates."""
    has_prior = name in costs
    for attempt in range(attempts):
        cost = measure()
        reason = check_tier(cost)
        if reason is None:
            costs[name] = cost
            return
        log.warning("calibration %d/%d rejected: %s", attempt + 1, attempts, reason)
        if not has_prior:
            costs[name] = cost
    untrusted.add(name)
