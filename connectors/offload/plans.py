"""What the offload connector's scheduler side plans for one request, and the policy choosing it.

``get_num_new_matched_tokens`` asks the store which leading blocks past the GPU hit the tiers
hold, then ``decide`` picks how much of that run to load under the configured policy:

- ``load``: every available block, as one prefix load;
- ``recompute``: none;
- ``cost``: the online cost model's cheapest option (load a prefix, recompute, or an overlap
  split: Cake's head computed while the tail loads);
- ``overlap``: the cheapest overlap split the cost model priced, forced (``cheapest_overlap``).

``cost`` prices its options behind the load backlog when given one (blocks per tier that loads
already started still read on the one load thread: ``OnlineCostModel.decide``'s ``backlog``).
A tier the cost model has no price for makes the safe choice: recompute. The answer is kept as
a ``Plan`` until the request's blocks are allocated; ``record_plan`` writes the chosen split to
the request for the request log. Torch-free (the scheduler thread).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from cachestore.cost.model import Decision, Option, Strategy
from cachestore.cost.online import OnlineCostModel
from cachestore.hashing import BlockKey
from cachestore.store.loads import LoadSpec
from engine.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """The answer of ``get_num_new_matched_tokens`` for one request, kept for the allocation."""

    num_computed_tokens: int
    keys: tuple[BlockKey, ...]  # every available block's key past the GPU hit
    tiers: tuple[str, ...]  # the tier serving each of them
    num_head_blocks: int  # computed while the load runs (overlap), else 0
    num_load_blocks: int  # loaded after the head
    decision: Strategy
    # In-step: the prepared load holding the located (pinned) slots of the first
    # num_load_blocks keys.
    spec: LoadSpec | None = None
    num_unlocated: int = 0  # chosen blocks whose slot failed its header check or was gone
    predicted_s: float = 0.0  # the cost model's TTFT for the chosen option (0: not priced)
    # A host-only load made async because its step already had its in-step loads.
    deferred: bool = False
    # Seconds of lower-tier reads queued on the load thread that the options were priced
    # behind (0: none, or not priced).
    backlog_s: float = 0.0
    # (strategy, raw price s, ratio) of the options ``cost`` weighed, chosen first (empty:
    # not priced): the request log's ``kv_plan.options``.
    options: tuple[tuple[str, float, float], ...] = ()

    @property
    def slab_offsets(self) -> tuple[int, ...]:
        """In-step: the slab offset of each of the first num_load_blocks keys' slots."""
        return self.spec.host_offsets if self.spec is not None else ()


@dataclass(frozen=True, slots=True)
class Choice:
    """What ``decide`` picked, and the load backlog it was priced behind (seconds; 0 when
    there was none or the policy prices nothing)."""

    option: Option
    backlog_s: float = 0.0
    options: tuple[tuple[str, float, float], ...] = ()  # ``Decision.priced``: what it weighed


def decide(
    policy: str,
    cost_model: OnlineCostModel,
    num_gpu_blocks: int,
    tiers: tuple[str, ...],
    num_tokens: int,
    overlap: bool = True,
    backlog: Mapping[str, int] | None = None,
) -> Choice:
    """The option ``policy`` takes for a request of ``num_tokens`` tokens whose first
    ``num_gpu_blocks`` blocks hit on the GPU and whose next ``len(tiers)`` blocks the tiers
    hold (``tiers[i]`` serving block ``i``). ``overlap`` False: ``cost`` prices no overlap
    split (the forced ``overlap`` policy still takes one). ``backlog``: blocks per tier still
    to be read on the load thread by loads already started (``cost`` and ``overlap`` price
    behind them)."""
    if policy == "load":
        return Choice(Option(Strategy.LOAD_PREFIX, 0, len(tiers), 0.0))
    if policy == "recompute":
        return Choice(Option(Strategy.RECOMPUTE, 0, 0, 0.0))
    try:
        decision = cost_model.decide(
            num_gpu_blocks,
            list(tiers),
            num_tokens,
            overlap=overlap or policy == "overlap",
            backlog=backlog,
        )
    except ValueError as exc:  # a tier the model has no price for: do the safe thing
        log.warning("cost model cannot price %s: %s; recomputing", tiers, exc)
        return Choice(Option(Strategy.RECOMPUTE, 0, 0, 0.0))
    if policy == "overlap":
        return Choice(cheapest_overlap(decision, len(tiers)), decision.backlog_s)
    return Choice(decision.best, decision.backlog_s, decision.priced())


def cheapest_overlap(decision: Decision, num_cached: int) -> Option:
    """The forced ``overlap`` policy: the cheapest overlap split the model priced; with fewer
    than two cached blocks there is none, and everything is loaded."""
    splits = [o for o in (decision.best, *decision.alternatives) if o.strategy == Strategy.OVERLAP]
    if not splits:
        return Option(Strategy.LOAD_PREFIX, 0, num_cached, 0.0)
    return min(splits, key=lambda o: (o.predicted_s, o.num_load_blocks))


def record_plan(
    request: Request, plan: Plan, num_gpu_tokens: int, num_head_tokens: int, num_load_tokens: int
) -> None:
    """The planned split, for the request log (measured parts come later)."""
    if num_load_tokens:
        request.kv_decision = plan.decision
    request.kv_plan = {
        "gpu_tokens": num_gpu_tokens,
        "head_tokens": num_head_tokens,
        "load_tokens": num_load_tokens,
        "recompute_tokens": request.num_prompt_tokens - num_gpu_tokens - num_load_tokens,
        "predicted_s": round(plan.predicted_s, 6),
        "backlog_s": round(plan.backlog_s, 6),
        # why the plan won: each option's raw price and the measured-to-priced ratio of its
        # kind that ranked it (the first is the chosen one's)
        "options": _options(plan.options),
    }


def _options(priced: tuple[tuple[str, float, float], ...]) -> dict[str, list[float]]:
    """``{strategy: [raw price s, ratio]}``, the first option of each strategy (the chosen
    one comes first)."""
    out: dict[str, list[float]] = {}
    for kind, price, ratio in priced:
        out.setdefault(kind, [round(price, 6), round(ratio, 4)])
    return out
