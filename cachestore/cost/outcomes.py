"""What each kind of decision took against what it was priced at, and the ranking that uses it.

The cost model prices an option from its parts (tier reads, copies, a prefill curve learned on
clean steps). What a user sees can differ by a factor the parts do not show: an overlap split's
tail copies slow down beside its head's compute, a load shares its step with others' chunks.
On one H200 (bench.offload, 4K tokens from LMDB) the overlap split was priced at 55 ms and took
87-97 ms while loading everything was priced at 50-63 ms and took 76-93 ms, so ``cost`` chose
the slower plan.

``OutcomeRatios`` keeps, per strategy and per prompt-length bucket (powers of two of blocks),
a running ratio of the measured time (the request's load, wait and compute phases: what the
price covers) to the price. The first sample of a key sets it; later ones move it by ``alpha``
(an EWMA), each sample clamped to [1/4, 4]. A key never seen falls back to its strategy's
ratio over every length, and a strategy never seen to 1 (its price as is).

A ratio above 1 steers decisions away from its strategy, so it would never be measured again:
one slow outlier (a length's first request meeting kernels not yet compiled, a cold page
cache) or a slowdown that has since gone would stick. So each outcome observed at a length
relaxes the other strategies' ratios above 1 at that length toward 1 (by ``relax``: 1 + (r - 1)
* relax), a key not yet seen there starting from its strategy's ratio: a strategy that lost
on its measured ratio is tried again after a few requests, and keeps losing if it measured
slow again. Toward 1, or toward the ratio the measured strategy itself has at that length
when that is higher (since the twenty-fourth session): a ratio above 1 that every plan shares
(the load path slower than its parts, priced into load-all and a split's tail alike) is
common to them, not a verdict on one; relaxing a measured competitor toward 1 on each outcome
made two plans measured at ~2.9x take turns, each looking 13% cheaper after the other's
outcome, where the faster one should keep running. On the H200 the 4K overlap measured
1.6-1.8x its price; with ``relax`` 0.8 a split at 1.8x, priced 20% under the load it lost to,
is tried again after seven loads of that length (1 + 0.8 * 0.8^n under 1.2). The plans
chosen instead may teach nothing, though (an engine whose connector reports no outcome, one
whose loads are dropped: recomputed, not measured).
So ``decided`` counts the decisions at a length since its last measured outcome, and once
more than ``UNMEASURED_DECISIONS`` went by, each decision that goes against the strategy the
prices alone chose relaxes that strategy's ratio the same way. On the H200 QA run with
compressed blocks one first reload at 8.7x its price (kept as 4x), with every recompute after
it unmeasured, made the next 44 reused requests recompute; now the load is tried again after
eight.

``rerank`` orders a ``Decision``'s options (the best and the best of each family) by price
times ratio, keeping the overlap margin: an overlap split is taken only when its adjusted price
beats the best other option's by that fraction. The options keep their raw prices, so each
observation compares a measurement with the model's own price, never with an adjusted one.

Ratios correct a price by a factor; they do not choose a plan the model prices at several
times another: an option priced more than ``OUTCOME_SPAN`` (2.5) times the cheapest is never
chosen on them. A ratio also carries what the price leaves out and no plan controls (a step
shared with other prompts, a wait behind another request's load), so every strategy measured
under load reads slow, and an unmeasured one (ratio 1) wins on that alone. With the
production-stack QA client on an H200 (48 GiB host tier) stalled host loads put load-all at 4x
its 18 ms price, and recompute, never measured and priced at 41-65 ms for ~4.3K tokens (a
prefill model taught by chunks timed before their kernels ran) won for the next 26 requests:
later-round TTFT fell from ~2.7x better than no offload to 1.06x. Correctly priced (~130 ms)
it is 7x the load and stays out. With a 2 GiB host tier over LMDB in the same run, loads
measured 1.9-2.2x their prices beside a recompute priced 1.9x the cheapest split: the span
lets that correction through.

And ratios may take an unmeasured overlap split away, never bring one in: a split competes
only when the model chose it on raw prices (with its margin). A split of a host-tier prefix
saves a few percent on paper (computing 14 blocks instead of copying them: 20.5 against 21.1
ms, inside the margin), while a load measured beside other requests reads 1.8x and an
unmeasured split 1; on the H200 QA runs the host-tier mode took 27 such splits in one run
(2.38x better than no offload) and none in another (3.49x).

A split measured at this length is another matter: its ratio is evidence, not a default of 1,
so it competes whether or not the raw prices chose it, and against the smaller
``MEASURED_OVERLAP_MARGIN`` (``measured_margin``). The full margin covers an unmeasured
prediction (two of them at once: the head's compute and the tail's load); once the split's
outcome is measured, the adjusted price already carries that error, and a margin of 15% on
top would keep a split that is truly 9% faster from ever running. On an H100 (twenty-third
session, ``bench.offload`` at 16K tokens from LMDB) the forced split took 158.0 ms and
load-all 174.0, and ``decision: cost`` loaded all six times (167.8 ms, 1.06x the best): a split
measured there could only win by 15%. With 4% a measured split and a measured load within 4%
of each other are both "at par" (either is within 1.04x of the other, inside issue 28's
1.05x), and noise cannot flip the choice at every request.
A split that is never chosen is never measured, though, and then nothing brings it in even
where the prices are known to be wrong: on the H100's 16K reload above, ``cost`` loaded all six
times and never split once, so the split's margin was not even the question (the row kept no
prices to say why; one reading that fits: the LMDB tier's learned read rate prices load-all
far under its measured time, and the split's tail load, priced at the same rate, with it,
inside the margin). So ``explore`` tries an unmeasured split once per length, when the raw
prices put it under the plan chosen (the margin alone kept it out) and that plan's own ratio
at this length is measured above ``1 + margin`` (its price is known to be optimistic by more
than the margin protects against). Its outcome then gives it a ratio, and it competes as a
measured split. One request per length may be the slower plan; the QA run's host-tier splits
(measured slow beside other prompts) would be tried once and then lose on their ratio.

Pure (the ranking) and not thread-safe (the ratios: the cost model holds its lock). No torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cachestore.cost.model import Decision, Option, Strategy

OUTCOME_ALPHA = 0.3  # weight of a new sample once a key has one
OUTCOME_RELAX = 0.8  # a ratio above 1 of a strategy not taken, per outcome of another
RATIO_CLAMP = 4.0  # one sample's ratio is kept within [1/4, 4]
OUTCOME_SPAN = 2.5  # ratios choose only among options priced within this of the cheapest
UNMEASURED_DECISIONS = 3  # decisions at a length without an outcome before ``decided`` relaxes
# The overlap margin once the split's own outcome was measured at that length (module docstring).
MEASURED_OVERLAP_MARGIN = 0.04


def length_bucket(num_prompt_tokens: int, block_tokens: int) -> int:
    """Powers of two of the prompt's blocks: 4K and 16K tokens fall in different buckets."""
    return max(0, math.ceil(math.log2(max(1, num_prompt_tokens // max(1, block_tokens)))))


@dataclass(slots=True)
class _Ratio:
    value: float
    num_samples: int


class OutcomeRatios:
    def __init__(self, alpha: float = OUTCOME_ALPHA, relax: float = OUTCOME_RELAX) -> None:
        """Raises ValueError for ``alpha`` outside (0, 1] or ``relax`` outside [0, 1]."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 <= relax <= 1.0:
            raise ValueError(f"relax must be in [0, 1], got {relax}")
        self.alpha = alpha
        self.relax = relax
        self._by_key: dict[tuple[str, int], _Ratio] = {}
        self._by_strategy: dict[str, _Ratio] = {}
        self._unmeasured: dict[int, int] = {}  # bucket -> decisions since its last outcome
        self._explored: set[int] = set()  # buckets where ``explore`` tried a split

    def observe(self, strategy: str, bucket: int, predicted_s: float, measured_s: float) -> bool:
        """One outcome; False (ignored) without a positive price and measurement."""
        if not (predicted_s > 0 and measured_s > 0):
            return False
        r = min(max(measured_s / predicted_s, 1.0 / RATIO_CLAMP), RATIO_CLAMP)
        self._unmeasured[bucket] = 0
        self._update(self._by_key, (str(strategy), bucket), r)
        self._update(self._by_strategy, str(strategy), r)
        self._relax_others(str(strategy), bucket, self._by_key[(str(strategy), bucket)].value)
        return True

    def decided(self, bucket: int, passed_over: str | None = None) -> None:
        """A decision at ``bucket``; ``passed_over``: the strategy its prices chose, when the
        ratios chose another. Past ``UNMEASURED_DECISIONS`` decisions there without a measured
        outcome, that strategy's ratio moves toward 1 (module docstring)."""
        count = self._unmeasured.get(bucket, 0) + 1
        self._unmeasured[bucket] = count
        if passed_over is None or count <= UNMEASURED_DECISIONS:
            return
        strategy = str(passed_over)
        cur = self._by_key.get((strategy, bucket))
        if cur is None:
            whole = self._by_strategy.get(strategy)
            if whole is None or whole.value <= 1.0:
                return
            cur = self._by_key[(strategy, bucket)] = _Ratio(whole.value, 0)  # a prior only
        if cur.value > 1.0:
            cur.value = 1.0 + (cur.value - 1.0) * self.relax

    def _relax_others(self, strategy: str, bucket: int, observed: float) -> None:
        """Another strategy's ratio at ``bucket`` above both 1 and the ratio just observed
        (``observed``, the measured strategy's at this length) moves toward the higher of the
        two (module docstring)."""
        target = max(1.0, observed)
        for other, whole in self._by_strategy.items():
            if other == strategy:
                continue
            cur = self._by_key.get((other, bucket))
            if cur is None:
                if whole.value <= target:
                    continue
                cur = self._by_key[(other, bucket)] = _Ratio(whole.value, 0)  # a prior only
            if cur.value > target:
                cur.value = target + (cur.value - target) * self.relax

    def _update(self, table: dict[Any, _Ratio], key: object, r: float) -> None:
        cur = table.get(key)
        if cur is None or cur.num_samples == 0:  # the first sample sets it
            table[key] = _Ratio(r, 1)
        else:
            cur.value += self.alpha * (r - cur.value)
            cur.num_samples += 1

    def explore(self, decision: Decision, bucket: int, overlap_margin: float) -> Decision:
        """``decision`` with its best overlap split as the plan, once per length, where that
        split was never measured at ``bucket``, its raw price is under the plan chosen, and
        the chosen plan's own ratio there is measured above ``1 + overlap_margin`` (module
        docstring); else ``decision`` unchanged."""
        chosen = decision.best
        splits = [o for o in decision.alternatives if o.strategy == Strategy.OVERLAP]
        if (
            chosen.strategy == Strategy.OVERLAP
            or not splits
            or bucket in self._explored
            or self.measured(Strategy.OVERLAP, bucket)
        ):
            return decision
        split = min(splits, key=lambda o: o.predicted_s)
        if not (
            split.predicted_s < chosen.predicted_s
            and self.measured(chosen.strategy, bucket)
            and self.ratio(chosen.strategy, bucket) > 1.0 + overlap_margin
        ):
            return decision
        self._explored.add(bucket)
        rest = tuple(o for o in (chosen, *decision.alternatives) if o != split)
        return replace(decision, best=split, alternatives=rest)

    def measured(self, strategy: str, bucket: int) -> bool:
        """Whether an outcome of ``strategy`` was measured at this length (its own samples, not
        the fallback to its ratio over every length)."""
        hit = self._by_key.get((str(strategy), bucket))
        return hit is not None and hit.num_samples > 0

    def ratio(self, strategy: str, bucket: int) -> float:
        """The adjustment for an option of ``strategy`` at this length (1: none known)."""
        hit = self._by_key.get((str(strategy), bucket)) or self._by_strategy.get(str(strategy))
        return hit.value if hit is not None else 1.0

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{strategy: {"all": ratio, "<bucket>": ratio, ...}}``, for logs and /metrics."""
        out: dict[str, dict[str, float]] = {
            s: {"all": round(r.value, 4)} for s, r in self._by_strategy.items()
        }
        for (s, b), r in self._by_key.items():
            out.setdefault(s, {})[str(b)] = round(r.value, 4)
        return out

    def explored(self) -> list[int]:
        """The lengths (buckets) at which ``explore`` tried a split, for logs."""
        return sorted(self._explored)


def rerank(
    decision: Decision,
    factor: Callable[[Option], float],
    overlap_margin: float,
    span: float | None = None,
    measured_margin: float | None = None,
) -> Decision:
    """``decision``'s options ordered by ``predicted_s * factor(option)``: the cheapest
    non-overlap option (ties: fewer loaded blocks), replaced by the cheapest overlap split when
    that is at least ``overlap_margin`` cheaper. Only options priced at most ``span`` (default
    ``OUTCOME_SPAN``) times the cheapest price compete (the model's own choice always does).
    A split competes only as the model's own choice, unless ``measured_margin`` is given (the
    split's outcome was measured at this length): then it competes in any case, against that
    margin instead. With every factor 1 and no ``measured_margin`` this is ``choose_split``'s
    own choice. Pure."""
    span = OUTCOME_SPAN if span is None else span
    everything = list(dict.fromkeys((decision.best, *decision.alternatives)))
    floor = min(o.predicted_s for o in everything)
    options = [o for o in everything if o == decision.best or o.predicted_s <= span * floor]

    def key(o: Option) -> tuple[float, int]:
        return (o.predicted_s * factor(o), o.num_load_blocks)

    plain = [o for o in options if o.strategy != Strategy.OVERLAP]
    # An unmeasured split competes only where the model chose it: ratios may take it away,
    # not bring it in; a measured one competes on its ratio (module docstring).
    measured = measured_margin is not None
    splits = [
        o for o in options if o.strategy == Strategy.OVERLAP and (measured or o == decision.best)
    ]
    margin = overlap_margin if measured_margin is None else measured_margin
    if not plain:
        return decision
    best = min(plain, key=key)
    if splits:
        split = min(splits, key=key)
        if key(split) < key(best) and key(split)[0] <= (1.0 - margin) * key(best)[0]:
            best = split
    return replace(decision, best=best, alternatives=tuple(o for o in everything if o != best))
