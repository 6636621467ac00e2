"""Start-up calibration: measure prefill and tier transfers, fit the cost model's priors.

Torch-free: the engine passes callbacks that do the device work.

- ``calibrate_prefill(run_prefill)`` times ``run_prefill(num_tokens, context_tokens)`` (it returns
  seconds) at a few sizes after one warm-up call, keeps the fastest of ``repeats`` runs per size
  and fits ``PrefillCost`` by least squares with non-negative coefficients.
- ``calibrate_copy(copy_blocks, block_bytes)`` fits a ``TierCost`` to the time
  ``copy_blocks(n)`` takes for 1 and for ``num_blocks`` blocks: two sizes separate the fixed
  latency from the bandwidth. The host -> GPU hop is measured this way with a torch callback.
- ``calibrate_tier(tier, block_bytes)`` does the same through a real tier's ``get_many`` on
  blocks it first writes with ``put_many`` under a private key prefix, and deletes them after.
- ``calibrate_transfer(load_blocks, block_bytes, name, sizes)`` times a whole caller-supplied
  transfer path (e.g. a lower tier -> host slab -> device load) at realistic batch sizes and
  fits latency + bandwidth by least squares over them (``fit_transfer``), so per-block costs
  (Python, page faults, checksums) show up in the bandwidth rather than vanishing in a small
  batch.
- ``calibrate_prefill_checked(...)`` measures until ``cachestore.cost.checks.check_prefill``
  accepts the fit (a bounded number of attempts), else falls back to a prior, untrusted.
- ``calibrate(...)`` runs all of them, checks every measurement (a tier that fails
  ``check_tier`` twice keeps its prior, untrusted) and returns a ready ``OnlineCostModel``.

Progress goes to stderr through tqdm. Safe to run while others use the tiers: it only adds and
removes its own keys (a random prefix), which may evict others' blocks from a full tier.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from cachestore.cost.checks import check_prefill, check_tier
from cachestore.cost.fit import fit_prefill_nonnegative
from cachestore.cost.model import PrefillCost, PrefillSample, TierCost
from cachestore.cost.online import CostPriors, OnlineCostModel
from tiers.base import Tier

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["fit_prefill_nonnegative"]  # re-exported: its home is cachestore.cost.fit
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


def calibrate_copy(
    copy_blocks: Callable[[int], float],
    block_bytes: int,
    name: str,
    *,
    num_blocks: int = 32,
    repeats: int = 3,
) -> TierCost:
    """Fit one hop from ``copy_blocks(n)`` (moves ``n`` blocks, returns seconds; the fastest of
    ``repeats`` counts) at ``n = 1`` and ``n = num_blocks``: ``B = (N-1)*b / (t_N - t_1)``,
    ``L = t_1 - b/B`` clamped at 0. When noise makes ``t_N <= t_1`` the bandwidth is taken as
    ``N*b / t_N``. Raises ValueError for ``num_blocks < 2`` or a non-positive time."""
    if num_blocks < 2 or block_bytes <= 0:
        raise ValueError(
            f"need num_blocks >= 2 and block_bytes > 0, got {num_blocks}, {block_bytes}"
        )
    copy_blocks(1)  # warm-up
    t1 = min(copy_blocks(1) for _ in range(repeats))
    tn = min(copy_blocks(num_blocks) for _ in range(repeats))
    if not (t1 > 0 and tn > 0):
        raise ValueError(f"{name}: copy times must be > 0, got {t1}, {tn}")
    if tn > t1:
        bandwidth = (num_blocks - 1) * block_bytes / (tn - t1)
    else:
        bandwidth = num_blocks * block_bytes / tn
    return TierCost(name, max(t1 - block_bytes / bandwidth, 0.0), bandwidth)


def calibrate_tier(
    tier: Tier, block_bytes: int, num_blocks: int = 32, *, repeats: int = 3
) -> TierCost:
    """Time ``get_many`` of real blocks through ``tier`` (see ``calibrate_copy``). Writes
    ``num_blocks`` random blocks under a private prefix first and deletes them in any case.
    Raises TierError when the tier fails, ValueError when it did not keep the blocks."""
    prefix = f"kvtier-calibration-{uuid.uuid4().hex}/"
    keys = [f"{prefix}{i:08x}" for i in range(num_blocks)]
    payload = os.urandom(block_bytes)
    try:
        tier.put_many([(k, payload) for k in keys])
        if tier.lookup(keys) != num_blocks:
            raise ValueError(
                f"tier {tier.name!r} kept fewer than {num_blocks} blocks of "
                f"{block_bytes} bytes; give it more capacity or fewer blocks"
            )

        def read(n: int) -> float:
            t0 = time.perf_counter()
            values = tier.get_many(keys[:n])
            for v in values:
                if v is None or len(v) != block_bytes:
                    raise ValueError(f"tier {tier.name!r} lost a calibration block")
                if isinstance(v, memoryview):  # a zero-copy view is read only when copied out
                    bytes(v)
            return time.perf_counter() - t0

        return calibrate_copy(read, block_bytes, tier.name, num_blocks=num_blocks, repeats=repeats)
    finally:
        tier.delete_many(keys)


@dataclass(frozen=True, slots=True)
class TransferSample:
    """``num_blocks`` blocks moved in ``seconds`` (the fastest of a size's repeats)."""

    num_blocks: int
    seconds: float


@dataclass(frozen=True, slots=True)
class TransferFit:
    """A fitted transfer path and the samples it was fitted to."""

    cost: TierCost
    samples: tuple[TransferSample, ...]

    def predict(self, num_blocks: int, block_bytes: int) -> float:
        """Seconds the fit gives for ``num_blocks`` blocks of ``block_bytes``."""
        return self.cost.latency_s + num_blocks * block_bytes / self.cost.bandwidth_bytes_per_s


def fit_transfer(samples: Sequence[TransferSample], block_bytes: int, name: str) -> TierCost:
    """Least squares of ``t = L + n * block_bytes / B`` with ``L >= 0``, ``B > 0``: a free fit;
    a negative intercept refits through the origin; a slope <= 0 (noise, or a fixed cost that
    dwarfs the bytes) takes ``B`` from the largest size alone and ``L`` from the smallest, as
    ``calibrate_copy`` does. Pure. Raises ValueError with fewer than 2 distinct sizes, a size
    < 1, a time <= 0 or ``block_bytes <= 0``."""
    if block_bytes <= 0 or len({s.num_blocks for s in samples}) < 2:
        raise ValueError(
            f"need block_bytes > 0 and >= 2 distinct sizes, got {block_bytes}, "
            f"{[s.num_blocks for s in samples]}"
        )
    if any(s.num_blocks < 1 or not s.seconds > 0 for s in samples):
        raise ValueError(f"{name}: sizes must be >= 1 and times > 0, got {list(samples)}")
    ns = [float(s.num_blocks) for s in samples]
    ts = [s.seconds for s in samples]
    n_mean, t_mean = sum(ns) / len(ns), sum(ts) / len(ts)
    slope = sum((n - n_mean) * (t - t_mean) for n, t in zip(ns, ts, strict=True)) / sum(
        (n - n_mean) ** 2 for n in ns
    )  # seconds per block
    latency = t_mean - slope * n_mean
    if slope > 0 and latency < 0:
        slope, latency = (
            sum(n * t for n, t in zip(ns, ts, strict=True)) / sum(n * n for n in ns),
            0.0,
        )
    if not slope > 0:
        big = max(samples, key=lambda s: s.num_blocks)
        small = min(samples, key=lambda s: s.num_blocks)
        slope = big.seconds / big.num_blocks
        latency = max(small.seconds - small.num_blocks * slope, 0.0)
    return TierCost(name, latency, block_bytes / slope)


def calibrate_transfer(
    load_blocks: Callable[[int], float],
    block_bytes: int,
    name: str,
    *,
    sizes: Sequence[int] = (16, 128),
    repeats: int = 2,
) -> TransferFit:
    """Fit one whole transfer path from ``load_blocks(n)`` (moves ``n`` blocks the way the
    caller's real loads do and returns the seconds; each call must start from the same state,
    e.g. cold: that reset is the callback's job and is not timed). One warm-up call at the
    smallest size, then the fastest of ``repeats`` per size; ``fit_transfer`` over them.
    Raises ValueError for ``repeats < 1`` or what ``fit_transfer`` refuses."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    load_blocks(min(sizes))  # warm-up: first-call allocations, imports, page mappings
    samples = tuple(
        TransferSample(n, min(float(load_blocks(n)) for _ in range(repeats)))
        for n in sorted(set(sizes))
    )
    return TransferFit(fit_transfer(samples, block_bytes, name), samples)


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
) -> OnlineCostModel:
    """Measure what can be measured and start an ``OnlineCostModel`` from it.

    The ``host`` entry is the host -> GPU hop that every load ends with: timed with
    ``host_to_gpu(n)`` when given (whether or not a host tier is in ``tiers``), else by reading
    the host tier if there is one (on a CPU engine that copy is the hop). Every other tier is
    timed with ``calibrate_tier`` on blocks of ``tier_block_bytes`` (default ``block_bytes``;
    pass the encoded size, codec header included, to move what a real load moves).
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
    with _progress(len(tiers), "calibrate tiers", progress) as bar:
        for tier in tiers:
            try:
                _checked(
                    partial(calibrate_tier, tier, tier_block_bytes or block_bytes, num_blocks),
                    tier.name,
                    costs,
                    untrusted,
                )
            except Exception as exc:  # a failing tier must not stop the engine from starting
                if tier.name not in costs:
                    raise ValueError(
                        f"tier {tier.name!r}: calibration failed ({exc}) and no prior is given"
                    ) from exc
            bar.update(1)
    for name, timer in (transfer_timers or {}).items():
        try:
            _checked(
                partial(
                    _transfer_cost, timer, tier_block_bytes or block_bytes, name, transfer_sizes
                ),
                name,
                costs,
                untrusted,
            )
        except Exception as exc:  # as for a tier: a prior, if any, stands in
            if name not in costs:
                raise ValueError(
                    f"transfer {name!r}: calibration failed ({exc}) and no prior is given"
                ) from exc
    if run_prefill is not None:
        checked = calibrate_prefill_checked(
            run_prefill,
            prefill_sizes,
            fallback=priors.prefill if priors else None,
            progress=progress,
        )
        prefill, trusted = checked.cost, checked.trusted
    elif priors is not None:
        prefill, trusted = priors.prefill, True
    else:
        raise ValueError("calibrate needs run_prefill or priors for the prefill model")
    return OnlineCostModel(
        costs,
        prefill,
        block_bytes,
        block_tokens,
        alpha=alpha,
        prefill_trusted=trusted,
        untrusted_tiers=untrusted,
    )


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
