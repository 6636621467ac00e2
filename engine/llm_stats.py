"""``LLMEngine``'s numbers: ``stats()`` (flat counters and gauges, what ``/metrics`` exports)
and ``kv_stats()`` (KV reuse in detail), both read from the scheduler, the block pool and the
KV connector, if any. No side effect; the engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from engine.kv_stats import KVStats

if TYPE_CHECKING:
    from engine.kv_connector import KVConnector
    from engine.sched.block_pool import BlockPool
    from engine.sched.scheduler import Scheduler

# stats() name -> the connector counter (``KVConnector.counters.snapshot()``) it reports.
_KV_COUNTERS = {
    "kv_gpu_hit_tokens_total": "gpu_hit_tokens",
    "kv_loaded_tokens_total": "loaded_tokens",
    "kv_recomputed_tokens_total": "recomputed_tokens",
    "kv_saved_bytes_total": "saved_bytes",
    "kv_loaded_bytes_total": "loaded_bytes",
    "kv_failed_loads_total": "failed_loads",
    "kv_load_seconds_total": "load_seconds",
}


def engine_stats(
    scheduler: Scheduler,
    pool: BlockPool,
    connector: KVConnector | None,
    *,
    prompt_tokens_total: int,
    generation_tokens_total: int,
) -> dict[str, Any]:
    """Counters (``*_total``, monotonic) and gauges, flat numbers only; with a connector its
    ``kv_*_total`` counters too."""
    s = scheduler.stats
    return {
        "num_requests_running": scheduler.num_running,
        "num_requests_waiting": scheduler.num_waiting,
        "prompt_tokens_total": prompt_tokens_total,
        "generation_tokens_total": generation_tokens_total,
        "prefix_cache_hit_tokens_total": s.prefix_cache_hit_tokens_total,
        "prefix_cache_queried_tokens_total": s.prefix_cache_queried_tokens_total,
        "num_preemptions_total": s.num_preemptions_total,
        "num_released_loads_total": s.num_released_loads_total,
        "num_schedule_steps": s.num_schedule_steps,
        "schedule_seconds_total": s.schedule_seconds_total,
        "num_blocked_skips": s.num_blocked_skips,
        "num_first_token_deferred_tokens": s.num_first_token_deferred_tokens,
        "num_load_wait_deferred_tokens": s.num_load_wait_deferred_tokens,
        "gpu_blocks_total": pool.num_blocks,
        "gpu_blocks_free": pool.num_free_blocks,
        "gpu_cache_usage": pool.usage(),
        **kv_counters(connector),
    }


def kv_counters(connector: KVConnector | None) -> dict[str, int | float]:
    """The connector's counters under their ``stats()`` names (none without a connector)."""
    if connector is None:
        return {}
    kv = connector.counters.snapshot()
    return {name: kv[counter] for name, counter in _KV_COUNTERS.items()}


def kv_stats(scheduler: Scheduler, connector: KVConnector | None) -> KVStats:
    """The connector's ``stats()``; without one, the GPU prefix hits and empty counters."""
    if connector is not None:
        return cast(KVStats, connector.stats())
    return {
        "gpu_hit_tokens": scheduler.stats.prefix_cache_hit_tokens_total,
        "loaded_tokens": 0,
        "recomputed_tokens": 0,
        "tiers": {},
        "decisions": {},
        "failed_loads": 0,
    }
