"""What the offload connector's scheduler side plans for one request, and the policy choosing it.

``get_num_new_matched_tokens`` asks the store which leading blocks past the GPU hit the tiers
hold, then ``decide`` picks how much of that run to load under the configured policy:

- ``load``: every available block, as one prefix load;
- ``recompute``: none;
- ``cost``: the online cost model's cheapest option (load a prefix, recompute, or an overlap
  split: Cake's head computed while the tail loads);
- ``overlap``: the cheapest overlap split the cost model priced, forced (``cheapest_overlap``).

A tier the cost model has no price for makes the safe choice: recompute. The answer is kept as
a ``Plan`` until the request's blocks are allocated; ``record_plan`` writes the chosen split to
the request for the request log. Torch-free (the scheduler thread).
"""

from __future__ import annotations

import logging
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

    @property
    def slab_offsets(self) -> tuple[int, ...]:
        """In-step: the slab offset of each of the first num_load_blocks keys' slots."""
        return self.spec.host_offsets if self.spec is not None else ()


def decide(
    policy: str,
    cost_model: OnlineCostModel,
    num_gpu_blocks: int,
    tiers: tuple[str, ...],
    num_tokens: int,
    overlap: bool = True,
) -> Option:
    """The option ``policy`` takes for a request of ``num_tokens`` tokens whose first
    ``num_gpu_blocks`` blocks hit on the GPU and whose next ``len(tiers)`` blocks the tiers
    hold (``tiers[i]`` serving block ``i``). ``overlap`` False: ``cost`` prices no overlap
    split (the forced ``overlap`` policy still takes one)."""
    if policy == "load":
        return Option(Strategy.LOAD_PREFIX, 0, len(tiers), 0.0)
    if policy == "recompute":
        return Option(Strategy.RECOMPUTE, 0, 0, 0.0)
    try:
        decision = cost_model.decide(
            num_gpu_blocks, list(tiers), num_tokens, overlap=overlap or policy == "overlap"
        )
    except ValueError as exc:  # a tier the model has no price for: do the safe thing
        log.warning("cost model cannot price %s: %s; recomputing", tiers, exc)
        return Option(Strategy.RECOMPUTE, 0, 0, 0.0)
    if policy == "overlap":
        return cheapest_overlap(decision, len(tiers))
    return decision.best


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
    }
