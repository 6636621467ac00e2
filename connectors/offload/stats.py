"""Counters of the KV offload connector, shared by its scheduler and worker sides.

Token counters (per admission of a request, a preempted request counting again):
- ``gpu_hit_tokens``: prompt tokens served by the GPU prefix cache;
- ``loaded_tokens``: tokens whose KV was loaded from the tiers (valid blocks only);
- ``recomputed_tokens``: tokens the tiers held but that were computed anyway (the decision
  chose recompute for them, or their load failed, came back short or timed out);
- ``overlap_head_tokens``: of those, the heads computed while an overlap's tail loaded
  (``num_overlaps`` such requests).

One gauge (``set``, not ``add``): ``load_backlog_blocks``, the blocks below the host tier that
async loads in flight still hold on the worker's one load thread (the scheduler side's
``load_backlog``); ``backlog_decisions`` counts the decisions priced behind a non-empty one.

Thread-safe (one lock): the worker side updates transfer counters from its load thread.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cachestore.cost.model import Strategy


@dataclass(slots=True)
class OffloadStats:
    gpu_hit_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    save_skipped_blocks: int = 0  # already held by the store (dedup)
    save_incompressible_blocks: int = 0  # compression lost escapes: not stored (kv_compress)
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    num_loads: int = 0
    failed_loads: int = 0  # loads that came back short (missing/corrupt block, tier down)
    timed_out_loads: int = 0
    cancelled_loads: int = 0
    overlap_head_tokens: int = 0
    num_overlaps: int = 0
    num_lookups: int = 0  # tier lookups made for admissions (scheduler side)
    lookup_blocks: int = 0  # blocks those lookups asked about (over loaded_blocks: the waste)
    in_step_deferred_loads: int = 0  # host loads made async: their step had its in-step loads
    shared_step_decisions: int = 0  # cost decisions with no overlap offered (a shared step)
    shared_step_outcomes: int = 0  # outcomes taught with others' step tokens priced in
    backlog_decisions: int = 0  # cost decisions priced behind other loads' queued reads
    load_backlog_blocks: int = 0  # gauge: lower-tier blocks of async loads in flight
    prefetched_blocks: int = 0  # read up into the host tier while their request waited
    prefetch_used_blocks: int = 0  # of those, loaded by their request
    prefetch_wasted_blocks: int = 0  # of those, released unused
    decisions: Counter[str] = field(default_factory=Counter)
    tier_hit_blocks: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        """Add to named counters atomically. Raises AttributeError on an unknown name."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, _scalar(name), getattr(self, name) + delta)

    def set(self, **values: float) -> None:
        """Set named gauges atomically. Raises AttributeError on an unknown name (slots)."""
        with self._lock:
            for name, value in values.items():
                setattr(self, _scalar(name), value)

    def count_decision(self, decision: Strategy) -> None:
        with self._lock:
            self.decisions[decision] += 1

    def count_tier_hits(self, tier_names: list[str]) -> None:
        with self._lock:
            self.tier_hit_blocks.update(tier_names)

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy as plain values (JSON-ready)."""
        with self._lock:
            out: dict[str, Any] = {
                name: getattr(self, name)
                for name in self.__slots__  # type: ignore[attr-defined]
                if not name.startswith("_") and name not in ("decisions", "tier_hit_blocks")
            }
            out["decisions"] = dict(self.decisions)
            out["tiers"] = {name: {"hit_blocks": n} for name, n in self.tier_hit_blocks.items()}
        return out


def _scalar(name: str) -> str:
    """``name`` when it names one of the plain counters or gauges ``add`` and ``set`` may
    touch (not the lock, not the per-key Counters); AttributeError otherwise."""
    if name.startswith("_") or name in ("decisions", "tier_hit_blocks"):
        raise AttributeError(name)
    return name
