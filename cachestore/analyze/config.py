"""The configuration of one ``kvtier analyze`` run, besides the trace (``cli.build_config``
maps the flags onto it). Frozen values only."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachestore.analyze.simulate import TierSpec
from cachestore.cost.model import DEFAULT_TIER_COSTS, LLAMA3_8B_H200_PREFILL, PrefillCost, TierCost
from tiers.sizes import BLOCKS, UNBOUNDED, Size


@dataclass(frozen=True, slots=True)
class AnalyzeConfig:
    """Everything one analysis needs besides the trace (mapped 1:1 from CLI flags)."""

    tiers: tuple[TierSpec, ...]
    kv_bytes_per_token: int
    model_profile: str | None = None
    prefill: PrefillCost = LLAMA3_8B_H200_PREFILL
    tier_costs: dict[str, TierCost] = field(default_factory=lambda: dict(DEFAULT_TIER_COSTS))
    sweep_tier: str | None = None
    sweep_capacities: tuple[int | None, ...] = ()
    force_replay: bool = False  # replay even an all-LRU hierarchy (slower, same numbers)
    kv_compression: str = "none"  # the stored format kv_bytes_per_token already accounts for
    # The capacities as the user wrote them (unit and text, for the table and the plots'
    # axes), one per tier / sweep point; empty: blocks.
    tier_sizes: tuple[Size, ...] = ()
    sweep_sizes: tuple[Size, ...] = ()


def as_written(sizes: tuple[Size, ...], blocks: list[int | None]) -> list[Size]:
    """``sizes`` where given, else each capacity in blocks (``inf`` for unbounded)."""
    if len(sizes) == len(blocks):
        return list(sizes)
    return [
        Size(UNBOUNDED, None, "inf") if b is None else Size(BLOCKS, b, f"{b}blocks") for b in blocks
    ]
