"""Placement that follows the physics: which tiers a block is worth writing to at all.

A tier below the host pays only if some prefix read from it reaches the GPU sooner than the
engine recomputes it. The best case for a load is the longest prefix the engine serves: a
transfer's fixed latencies are paid once over the most bytes, and recompute grows faster than
linearly with length (attention). If even that prefix loads slower than it recomputes, no
shorter one loads faster, so under ``decision: cost`` no block written there would ever be
loaded: writing it only costs write bandwidth, CPU and space.

``unprofitable_tiers`` prices that best case for each tier with the cost model's current
figures (calibrated or priors); the offload connector passes the result to
``HierarchicalStore.skip_tiers`` when the config asks for ``placement: worth_loading``.
Pure; torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cachestore.cost.model import PrefillCost, TierCost, hops_to_gpu, reload_time


@dataclass(frozen=True, slots=True)
class TierVerdict:
    """One tier's best case: a ``prefix_tokens``-token prefix loads in ``load_s`` against
    ``recompute_s`` of prefill."""

    name: str
    prefix_tokens: int
    load_s: float
    recompute_s: float

    @property
    def pays(self) -> bool:
        return self.load_s < self.recompute_s


def tier_verdicts(
    costs: Mapping[str, TierCost],
    prefill: PrefillCost,
    *,
    block_bytes: int,
    block_tokens: int,
    max_prefix_tokens: int,
) -> list[TierVerdict]:
    """Every priced tier but ``host`` (the GPU's own spill space, always worth it), priced at
    the longest prefix of whole blocks up to ``max_prefix_tokens``. Raises ValueError for a
    non-positive block size or prefix."""
    if block_tokens <= 0 or block_bytes <= 0 or max_prefix_tokens < block_tokens:
        raise ValueError(
            f"need block_tokens, block_bytes > 0 and max_prefix_tokens >= "
            f"block_tokens, got {block_tokens}, {block_bytes}, {max_prefix_tokens}"
        )
    blocks = max_prefix_tokens // block_tokens
    tokens = blocks * block_tokens
    recompute = prefill.time(tokens, 0)  # the same prefix for every tier
    table = dict(costs)
    return [
        TierVerdict(
            name, tokens, reload_time(blocks, block_bytes, hops_to_gpu(name, table)), recompute
        )
        for name in table
        if name not in ("host", "gpu")
    ]


def unprofitable_tiers(
    costs: Mapping[str, TierCost],
    prefill: PrefillCost,
    *,
    block_bytes: int,
    block_tokens: int,
    max_prefix_tokens: int,
) -> list[TierVerdict]:
    """The verdicts of the tiers from which no prefix would ever be worth loading."""
    return [
        v
        for v in tier_verdicts(
            costs,
            prefill,
            block_bytes=block_bytes,
            block_tokens=block_tokens,
            max_prefix_tokens=max_prefix_tokens,
        )
        if not v.pays
    ]
