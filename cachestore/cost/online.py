"""The learning cost model: ``cachestore.cost.model`` prices, fed by live measurements.

``OnlineCostModel`` holds one ``TierCost`` per tier (the hop from that tier into pinned host
memory; for ``host`` the hop host -> GPU) and one ``PrefillCost`` times a learned scale factor.
``decide`` prices a request with ``choose_split``, behind the reads other loads have queued on
the load thread when the caller passes them (``backlog``); ``observe_transfer`` / ``observe_prefill``
move the estimates by an exponentially weighted moving average (EWMA) with weight ``alpha``:

- transfer of ``n`` bytes in ``t`` s on a tier with estimates ``(L, B)``: a sample whose
  predicted copy time ``n/B`` is below ``L`` (or ``n == 0``) is latency-dominated and moves
  the latency only: ``L += alpha * (max(t - n/B, 0) - L)``. Otherwise it moves the bandwidth
  only, averaged in seconds per byte: ``1/B += alpha * ((t - L) / n - 1/B)``, with ``t`` in
  place of ``t - L`` when ``t <= L`` (the latency estimate alone cannot explain the sample).
  Each sample informs the term that dominates it, holding the other fixed.
  A tier below host memory, and one whose calibration was rejected (``untrusted_tiers``),
  learns faster at first: its k-th sample weighs ``max(alpha, 1 / (k + 1))``.
- prefill of ``n`` tokens after ``c`` in ``t`` s: ``cachestore.cost.prefill_learner`` (a scale
  EWMA on the calibrated curve, and refits of the curve's shape from live samples of
  different lengths, so a wrong per-token slope is corrected too).

Trust: a prefill calibration that failed its checks (``prefill_trusted=False``) is not used
to refuse a load: until a live refit replaces it, ``decide`` loads every block a tier holds
(the data is there; the pricing is still reported).

Samples with ``seconds <= 0`` (clock resolution) carry no information and are counted as
ignored, and so is a transfer sample faster than ``MAX_PLAUSIBLE_RATE`` (1 TB/s: no hop
into host memory or from it to a GPU comes near it; a timing artifact, such as copies timed
by events that do not span them, reading as near-zero seconds: samples like that once moved
the host hop's learned rate from 50 GB/s to 5.6 TB/s, pricing every load as nearly free). Thread-safe: one lock guards the estimates; ``decide`` prices outside it on a
consistent copy. Torch-free, no I/O. See docs/cost_model.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cachestore.cost.model import (
    LLAMA3_8B_H200_PREFILL,
    TIER_COST_PRIORS,
    Decision,
    PrefillCost,
    Strategy,
    TierCost,
    choose_split,
    get_model_profile,
    hops_to_gpu,
    reload_time,
)
from cachestore.cost.outcomes import (
    MEASURED_OVERLAP_MARGIN,
    OutcomeRatios,
    length_bucket,
    rerank,
)
from cachestore.cost.prefill_learner import PrefillLearner

log = logging.getLogger(__name__)
# An overlap split must predict at least this much less than the best other option (cost_model).
OVERLAP_MARGIN = 0.15


@dataclass(frozen=True, slots=True)
class CostPriors:
    """Start-up estimates for one machine and model, before calibration or live samples."""

    name: str
    tier_costs: dict[str, TierCost]
    prefill: PrefillCost
    block_bytes: int  # KV bytes of one full block across all layers
    block_tokens: int = 16


# The CPU prior's prefill: the embedded demo model on a few cores (the tiers' prices are
# ``TIER_COST_PRIORS["cpu"]``); rough figures, calibrate.
_CPU_DEMO_PREFILL = PrefillCost(fixed_s=5e-3, per_token_s=60e-6, attention_s=5e-9)
_DEMO_KV_BYTES_PER_TOKEN = 4 * 4 * 32 * 2 * 4  # 4 layers x 4 KV heads x 32 x (K, V) x fp32


def default_priors(kind: str) -> CostPriors:
    """Priors by name: ``h200-llama-3-8b`` (DESIGN.md "Physics": host 55.4 GB/s, prefill 1K
    31 ms / 4K 120 ms / 16K 577 ms) or ``cpu`` (the demo model on a small CPU).
    Raises ValueError for another name."""
    if kind == "h200-llama-3-8b":
        block_bytes = get_model_profile("llama-3-8b").block_bytes(16)
        return CostPriors(kind, dict(TIER_COST_PRIORS["h200"]), LLAMA3_8B_H200_PREFILL, block_bytes)
    if kind == "cpu":
        return CostPriors(
            kind, dict(TIER_COST_PRIORS["cpu"]), _CPU_DEMO_PREFILL, _DEMO_KV_BYTES_PER_TOKEN * 16
        )
    raise ValueError(f"unknown cost prior {kind!r}; choose 'h200-llama-3-8b' or 'cpu'")


# Bytes per second above which a transfer sample is a timing artifact (module docstring).
MAX_PLAUSIBLE_RATE = 1e12


@dataclass(slots=True)
class _TierState:
    cost: TierCost
    prior: TierCost
    num_samples: int = 0
    trusted: bool = True


@dataclass(slots=True)
class _Counts:
    transfers_ignored: int = 0
    prefills_ignored: int = 0
    outcomes_ignored: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    predicted_saved_s: float = 0.0  # sum over decisions of (recompute - best) predicted


class OnlineCostModel:
    """Reload-versus-recompute decisions on EWMA-updated estimates. Thread-safe."""

    def __init__(
        self,
        tier_costs: dict[str, TierCost],
        prefill: PrefillCost,
        block_bytes: int,
        block_tokens: int,
        *,
        alpha: float = 0.2,
        prefill_trusted: bool = True,
        untrusted_tiers: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """``prefill_trusted``/``untrusted_tiers``: whether calibration passed its checks
        (see the module docstring). Raises ValueError for ``alpha`` outside (0, 1] or
        non-positive block sizes."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if block_bytes <= 0 or block_tokens <= 0:
            raise ValueError(
                f"need block_bytes > 0 and block_tokens > 0, got {block_bytes}, {block_tokens}"
            )
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.alpha = alpha
        # Keyed by the dict key, which is the name the connector reports (``TierCost.name``
        # is only a label).
        self._tiers = {
            name: _TierState(cost, cost, trusted=name not in untrusted_tiers)
            for name, cost in tier_costs.items()
        }
        # > 0: host-tier loads land layer by layer over this many layers while the rest of
        # the prompt is computed (set by the KV connector when its loads do that).
        self.pipelined_layers = 0
        # An overlap (Cake) split must beat the best other option by this fraction (see
        # cost_model.choose_split): its extra engine step is not priced.
        self.overlap_margin = OVERLAP_MARGIN
        # A curve that costs nothing per token prices every recompute like the shortest one:
        # never a reason to refuse a load, whoever passed it in.
        flat = prefill.per_token_s <= 0 and prefill.attention_s <= 0
        self._prefill = PrefillLearner(prefill, alpha, trusted=prefill_trusted and not flat)
        self._counts = _Counts()
        # Measured against priced time per kind of decision (cachestore.cost.outcomes).
        self._outcomes = OutcomeRatios()
        self._lock = threading.Lock()

    @classmethod
    def from_priors(cls, priors: CostPriors, *, alpha: float = 0.2) -> OnlineCostModel:
        return cls(
            dict(priors.tier_costs),
            priors.prefill,
            priors.block_bytes,
            priors.block_tokens,
            alpha=alpha,
        )

    # -- reading -------------------------------------------------------------------------

    def tier_costs(self) -> dict[str, TierCost]:
        """The current estimate of every tier (frozen values; a copy)."""
        with self._lock:
            return {name: s.cost for name, s in self._tiers.items()}

    def prefill_cost(self) -> PrefillCost:
        """The current prefill model: the curve (calibrated, or refit from live samples)
        times the learned scale."""
        with self._lock:
            return self._prefill.cost()

    def trusted(self) -> bool:
        """Whether the prefill model is trusted to refuse a load (see the module docstring)."""
        with self._lock:
            return self._prefill.trusted

    def backlog_seconds(self, backlog: Mapping[str, int]) -> float:
        """Seconds the load thread needs to read ``backlog`` (blocks per tier) at the current
        estimates: what ``decide`` adds to an option that reads below the host tier."""
        with self._lock:
            costs = {name: s.cost for name, s in self._tiers.items()}
        return _backlog_seconds(backlog, costs, self.block_bytes)

    def step_share_s(self, num_tokens: int) -> float:
        """Seconds ``num_tokens`` of other requests add to a step that computes a plan: the
        prefill model's price of that many tokens less its fixed per-step part (the plan's
        own price has it). Their contexts are not known, so they are priced as one chunk
        from an empty context, a lower bound: a decode or a chunk after cached tokens attends
        to more. What a shared step's outcome is measured against on top of its plan's price
        (the offload connector's ``observe_first_token``)."""
        if num_tokens <= 0:
            return 0.0
        with self._lock:
            prefill = self._prefill.cost()
        return max(prefill.time(num_tokens) - prefill.fixed_s, 0.0)

    def decide(
        self,
        num_gpu_hit_blocks: int,
        source_tiers: list[str],
        num_prompt_tokens: int,
        overlap: bool = True,
        *,
        backlog: Mapping[str, int] | None = None,
    ) -> Decision:
        """Price a prompt of ``num_prompt_tokens`` whose first ``num_gpu_hit_blocks`` blocks
        are on the GPU and whose next ``len(source_tiers)`` blocks are served by the named
        tiers (``source_tiers[i]`` for the i-th block after the GPU hit). A ``host`` block
        costs the host -> GPU hop; any other tier's block costs that tier -> host and
        host -> GPU, pipelined. ``overlap`` False prices no overlap split (``choose_split``).
        ``backlog``: blocks per tier that loads already started still have to read below the
        host tier; they run on the one load thread ahead of this request's lower-tier reads,
        so every option reading a non-host block is priced that much later
        (``backlog_seconds``; the decision's ``backlog_s``). None or empty: no backlog.
        Records the decision in the counters. Raises ValueError for an unknown tier or block
        counts that exceed the prompt."""
        if num_gpu_hit_blocks < 0:
            raise ValueError(f"num_gpu_hit_blocks must be >= 0, got {num_gpu_hit_blocks}")
        with self._lock:
            costs = {name: s.cost for name, s in self._tiers.items()}
            prefill = self._prefill.cost()
            trusted = self._prefill.trusted
        hops = {name: hops_to_gpu(name, costs) for name in set(source_tiers)}
        lead_host = next((i for i, t in enumerate(source_tiers) if t != "host"), len(source_tiers))
        backlog_s = _backlog_seconds(backlog or {}, costs, self.block_bytes)
        decision = choose_split(
            [hops[t] for t in source_tiers],
            self.block_tokens,
            self.block_bytes,
            num_prompt_tokens,
            prefill,
            computed_tokens=num_gpu_hit_blocks * self.block_tokens,
            pipelined_blocks=lead_host if self.pipelined_layers else 0,
            num_layers=max(self.pipelined_layers, 1),
            overlap_margin=self.overlap_margin,
            overlap=overlap,
            backlog_s=backlog_s,
            queued=[t != "host" for t in source_tiers] if backlog_s else None,
        )
        if not trusted and source_tiers:
            decision = _load_all(decision, len(source_tiers))
        else:  # each option's price times what its kind took against its price
            bucket = length_bucket(num_prompt_tokens, self.block_tokens)
            priced = decision.best.strategy
            with self._lock:
                outcomes = self._outcomes
                measured = outcomes.measured(Strategy.OVERLAP, bucket)
                decision = rerank(
                    decision,
                    lambda o: outcomes.ratio(o.strategy, bucket),
                    self.overlap_margin,
                    measured_margin=(
                        min(self.overlap_margin, MEASURED_OVERLAP_MARGIN) if measured else None
                    ),
                )
                # an unmeasured split under a plan measured slow: tried once (``overlap``
                # False prices no split, so there is none to try)
                decision = outcomes.explore(decision, bucket, self.overlap_margin)
                kinds = dict.fromkeys(
                    str(o.strategy) for o in (decision.best, *decision.alternatives)
                )
                decision = replace(
                    decision, ratios=tuple((k, outcomes.ratio(k, bucket)) for k in kinds)
                )
                lost = priced if decision.best.strategy != priced else None
                outcomes.decided(bucket, lost)  # lost on its ratio: retried in a while
        recompute = next(
            o.predicted_s
            for o in (decision.best, *decision.alternatives)
            if o.strategy == Strategy.RECOMPUTE
        )  # always priced by choose_split
        with self._lock:
            d = self._counts.decisions
            d[decision.best.strategy] = d.get(decision.best.strategy, 0) + 1
            self._counts.predicted_saved_s += recompute - decision.predicted_s
        log.debug(
            "cost decision: gpu_hit=%d cached=%d prompt=%d -> %s [%d, %d) %.6fs (recompute %.6fs"
            ", backlog %.6fs)",
            num_gpu_hit_blocks,
            len(source_tiers),
            num_prompt_tokens,
            decision.best.strategy,
            decision.best.load_begin,
            decision.best.load_end,
            decision.predicted_s,
            recompute,
            backlog_s,
        )
        return decision

    # -- learning ------------------------------------------------------------------------

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        """One measured transfer of ``nbytes`` from ``tier`` into host memory (``host``:
        host -> GPU). A tier seen for the first time starts from this sample (latency 0).
        Raises ValueError for negative ``nbytes``."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if not seconds > 0 or nbytes / seconds > MAX_PLAUSIBLE_RATE:
                self._counts.transfers_ignored += 1
                return
            state = self._tiers.get(tier)
            if state is None:
                if nbytes == 0:
                    self._counts.transfers_ignored += 1
                    return
                first = TierCost(tier, 0.0, nbytes / seconds)
                self._tiers[tier] = _TierState(first, first, 1)
                return
            # A tier below host memory, or one whose calibration was rejected, learns fast at
            # first: its start-up figure counts as one sample (a short read of a few blocks,
            # which the live loads of whole prefixes may not match).
            fast = not state.trusted or tier != "host"
            alpha = max(self.alpha, 1.0 / (state.num_samples + 2)) if fast else self.alpha
            state.cost = update_tier_cost(state.cost, nbytes, seconds, alpha)
            state.num_samples += 1

    def observe_outcome(
        self, strategy: str, num_prompt_tokens: int, predicted_s: float, measured_s: float
    ) -> None:
        """A served request: its decision's ``strategy``, the price ``decide`` gave it and the
        time its load, wait and compute took (the TTFT less queueing). Later decisions rank
        that strategy's options at that length by price times the ratio (``outcomes``)."""
        with self._lock:
            if not self._outcomes.observe(
                strategy,
                length_bucket(num_prompt_tokens, self.block_tokens),
                predicted_s,
                measured_s,
            ):
                self._counts.outcomes_ignored += 1

    def observe_prefill(self, num_tokens: int, context_tokens: int, seconds: float) -> None:
        """One measured prefill of ``num_tokens`` new tokens after ``context_tokens`` cached
        ones, alone in its step. Raises ValueError for negative counts."""
        if num_tokens < 0 or context_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_tokens}, {context_tokens}")
        with self._lock:
            if not self._prefill.observe(num_tokens, context_tokens, seconds):
                self._counts.prefills_ignored += 1

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view for logs and /metrics: current and prior estimates, sample counts,
        decision counts per strategy, predicted seconds saved against recomputing."""
        with self._lock:
            tiers = {
                name: {
                    "latency_s": s.cost.latency_s,
                    "bandwidth_bytes_per_s": s.cost.bandwidth_bytes_per_s,
                    "prior_latency_s": s.prior.latency_s,
                    "prior_bandwidth_bytes_per_s": s.prior.bandwidth_bytes_per_s,
                    "num_samples": s.num_samples,
                    "trusted": s.trusted,
                }
                for name, s in self._tiers.items()
            }
            learner, c = self._prefill, self._counts
            p = learner.base
            return {
                "alpha": self.alpha,
                "block_bytes": self.block_bytes,
                "block_tokens": self.block_tokens,
                "tiers": tiers,
                "prefill": {
                    "fixed_s": p.fixed_s,
                    "per_token_s": p.per_token_s,
                    "attention_s": p.attention_s,
                    "scale": learner.scale,
                    "num_samples": learner.num_samples,
                    "trusted": learner.trusted,
                    "num_refits": learner.num_refits,
                },
                "decisions": dict(c.decisions),
                "predicted_saved_s": c.predicted_saved_s,
                "ignored": {
                    "transfers": c.transfers_ignored,
                    "prefills": c.prefills_ignored,
                    "outcomes": c.outcomes_ignored,
                },
                "outcome_ratios": self._outcomes.snapshot(),
                "explored_splits": self._outcomes.explored(),
            }


def update_tier_cost(cost: TierCost, nbytes: int, seconds: float, alpha: float) -> TierCost:
    """One EWMA step of the module docstring's transfer rule; returns a new TierCost.
    Pure. ``seconds`` must be > 0."""
    copy_s = nbytes / cost.bandwidth_bytes_per_s
    if nbytes == 0 or copy_s < cost.latency_s:
        sample = max(seconds - copy_s, 0.0)
        return replace(cost, latency_s=cost.latency_s + alpha * (sample - cost.latency_s))
    transfer_s = seconds - cost.latency_s if seconds > cost.latency_s else seconds
    # The average runs in seconds per byte, the quantity a load's time is the sum of: a tier
    # that reads at a ninth of its calibrated rate is priced that slow within a few samples,
    # where an average of rates would hold it near the fast figure for many loads.
    per_byte = 1.0 / cost.bandwidth_bytes_per_s
    per_byte += alpha * (transfer_s / nbytes - per_byte)
    return replace(cost, bandwidth_bytes_per_s=1.0 / per_byte)


def _backlog_seconds(
    backlog: Mapping[str, int], costs: dict[str, TierCost], block_bytes: int
) -> float:
    """Seconds to read ``backlog`` (blocks per tier), each tier's blocks priced as a load of
    them is (``reload_time`` over ``hops_to_gpu``: that tier's hop and the host hop, one
    latency each). Host blocks are not read by the load thread, and a tier without a price
    cannot be priced: both count 0 (an unknown tier is already the safe choice, recompute,
    for the request that names it)."""
    return sum(
        reload_time(n, block_bytes, hops_to_gpu(tier, costs))
        for tier, n in backlog.items()
        if n > 0 and tier != "host" and tier in costs
    )


def _load_all(decision: Decision, num_cached: int) -> Decision:
    """``decision`` with loading every cached block as its best option (``choose_split``
    always prices that option: it is the best or among the alternatives)."""
    options = (decision.best, *decision.alternatives)
    load = next(
        o for o in options if o.strategy == Strategy.LOAD_PREFIX and o.load_end == num_cached
    )
    return replace(decision, best=load, alternatives=tuple(o for o in options if o != load))
