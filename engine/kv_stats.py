"""The typed result of ``LLM.kv_stats()`` / ``LLMEngine.kv_stats()``: what a KV-cache user
reads after a run. A TypedDict, so the value stays the plain JSON-ready dict it always was
(same keys) while editors and type checkers know each key.

Always present: ``gpu_hit_tokens``, ``loaded_tokens``, ``recomputed_tokens``, ``tiers``,
``decisions``, ``failed_loads``. With KV offload on, the connector's counters
(``connectors.offload.stats.OffloadStats``), the store's per-tier rows (``store``), the cost
model's snapshot and the decision policy come too (``total=False`` keys below).
"""

from __future__ import annotations

from typing import Any, TypedDict


class TierHits(TypedDict, total=False):
    """One tier's row in ``KVStats.tiers``: blocks loaded from it, and (offload) its write
    policy's counters."""

    hit_blocks: int
    written_through: int
    written_back: int
    write_queue_dropped: int
    write_queue_depth: int


class _KVStatsRequired(TypedDict):
    gpu_hit_tokens: int  # prompt tokens found in the GPU pool (prefix cache hits)
    loaded_tokens: int  # prompt tokens loaded from the tiers instead of computed
    recomputed_tokens: int  # tokens the tiers held but the decision policy recomputed
    tiers: dict[str, TierHits]  # by tier name: "host", "lmdb", "redis", "s3", "remote"
    decisions: dict[str, int]  # reload-versus-recompute decisions by outcome
    failed_loads: int  # loads that came back short (missing/corrupt block, tier down)


class KVStats(_KVStatsRequired, total=False):
    """``kv_stats()``'s value. Offload-only keys: block/byte counters and timings of saves
    and loads, lookups and prefetches, ``store`` (``{"tiers": [per-tier rows with hits,
    misses, errors, consecutive_failures, ...], "in_flight_stores", "load_pins"}``),
    ``cost_model`` and ``decision_policy``."""

    saved_blocks: int
    saved_bytes: int
    save_skipped_blocks: int
    save_incompressible_blocks: int
    loaded_blocks: int
    loaded_bytes: int
    load_seconds: float
    save_seconds: float
    num_loads: int
    timed_out_loads: int
    cancelled_loads: int
    overlap_head_tokens: int
    num_overlaps: int
    num_lookups: int
    lookup_blocks: int
    prefetched_blocks: int
    prefetch_used_blocks: int
    prefetch_wasted_blocks: int
    in_step_deferred_loads: int
    shared_step_decisions: int
    backlog_decisions: int
    load_backlog_blocks: int
    store: dict[str, Any]
    cost_model: dict[str, Any]
    decision_policy: str
