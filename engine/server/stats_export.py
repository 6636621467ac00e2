"""The engine's stats snapshot mapped onto the declared families of
``engine.server.metric_families`` (``SNAPSHOT_FAMILIES``), every one of them in every mode.

The snapshot (``engine.core.base.StatsSampler``) is ``LLMEngine.stats()`` (flat numbers; with
offload also ``kv_<name>_total`` counters) plus ``kv_stats()`` under ``"kv"`` (the connector's
``OffloadStats``, per-tier ``tiers`` rows, the store's ``store`` rows and the cost model's
``cost_model``; without offload only ``gpu_hit_tokens`` and empty rows). A connector value is
read from ``kv_<name>_total`` when present, else from ``kv[<name>]``, else 0. What no family
covers is dropped on purpose (docs/metrics.md lists it): duplicates (the connector's per-tier
write counters, the cost model's priced decisions), EWMAs that the histograms and byte
counters replace, static configuration, strings. Pure: new families per call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString

from cachestore.cost.model import Strategy
from engine.server.health import tier_rows
from engine.server.metric_families import SNAPSHOT_FAMILIES, Family

# Families read from one stats() key.
_ENGINE = {
    "kvtier_num_requests_running": "num_requests_running",
    "kvtier_num_requests_waiting": "num_requests_waiting",
    "kvtier_prompt_tokens_total": "prompt_tokens_total",
    "kvtier_generation_tokens_total": "generation_tokens_total",
    "kvtier_prefix_cache_queries_total": "prefix_cache_queried_tokens_total",
    "kvtier_prefix_cache_hits_total": "prefix_cache_hit_tokens_total",
    "kvtier_num_preemptions_total": "num_preemptions_total",
    "kvtier_scheduler_released_loads_total": "num_released_loads_total",
    "kvtier_gpu_cache_usage_ratio": "gpu_cache_usage",
    "kvtier_gpu_cache_blocks": "gpu_blocks_total",
    "kvtier_gpu_cache_free_blocks": "gpu_blocks_free",
    "kvtier_scheduler_steps_total": "num_schedule_steps",
    "kvtier_scheduler_seconds_total": "schedule_seconds_total",
    "kvtier_scheduler_blocked_skips_total": "num_blocked_skips",
    "kvtier_scheduler_first_token_deferred_tokens_total": "num_first_token_deferred_tokens",
    "kvtier_scheduler_load_wait_deferred_tokens_total": "num_load_wait_deferred_tokens",
}
# Families read from one connector counter or gauge (kv_<key>_total, or kv[key]).
_CONNECTOR = {
    "kvtier_kv_loaded_tokens_total": "loaded_tokens",
    "kvtier_kv_recomputed_tokens_total": "recomputed_tokens",
    "kvtier_kv_overlap_head_tokens_total": "overlap_head_tokens",
    "kvtier_kv_overlaps_total": "num_overlaps",
    "kvtier_kv_loaded_blocks_total": "loaded_blocks",
    "kvtier_kv_loaded_bytes_total": "loaded_bytes",
    "kvtier_kv_failed_loads_total": "failed_loads",
    "kvtier_kv_timed_out_loads_total": "timed_out_loads",
    "kvtier_kv_cancelled_loads_total": "cancelled_loads",
    "kvtier_kv_saved_blocks_total": "saved_blocks",
    "kvtier_kv_saved_bytes_total": "saved_bytes",
    "kvtier_kv_save_seconds_total": "save_seconds",
    "kvtier_kv_save_skipped_blocks_total": "save_skipped_blocks",
    "kvtier_kv_save_incompressible_blocks_total": "save_incompressible_blocks",
    "kvtier_kv_lookups_total": "num_lookups",
    "kvtier_kv_lookup_blocks_total": "lookup_blocks",
    "kvtier_kv_prefetched_blocks_total": "prefetched_blocks",
    "kvtier_kv_prefetch_used_blocks_total": "prefetch_used_blocks",
    "kvtier_kv_prefetch_wasted_blocks_total": "prefetch_wasted_blocks",
    "kvtier_kv_in_step_deferred_loads_total": "in_step_deferred_loads",
    "kvtier_kv_shared_step_decisions_total": "shared_step_decisions",
    "kvtier_kv_shared_step_outcomes_total": "shared_step_outcomes",
    "kvtier_kv_backlog_decisions_total": "backlog_decisions",
    "kvtier_kv_load_backlog_blocks": "load_backlog_blocks",  # a gauge, read the same way
}
# Families read from one key of each store tier row (``HierarchicalStore.stats()["tiers"]``).
_TIER_ROW = {
    "kvtier_kv_tier_hits_total": "hits",
    "kvtier_kv_tier_misses_total": "misses",
    "kvtier_kv_tier_read_bytes_total": "bytes_read",
    "kvtier_kv_tier_written_bytes_total": "bytes_written",
    "kvtier_kv_tier_errors_total": "errors",
    "kvtier_kv_tier_corrupt_total": "corrupt",
    "kvtier_kv_tier_skipped_total": "skipped",
    "kvtier_kv_tier_evictions_total": "evictions",
    "kvtier_kv_tier_demoted_total": "demoted",
    "kvtier_kv_tier_demotions_dropped_total": "demotions_dropped",
    "kvtier_kv_tier_dropped_at_bottom_total": "dropped_at_bottom",
    "kvtier_kv_tier_promotions_total": "promotions",
    "kvtier_kv_tier_promotions_dropped_total": "promotions_dropped",
    "kvtier_kv_tier_written_through_total": "written_through",
    "kvtier_kv_tier_written_back_total": "written_back",
    "kvtier_kv_tier_inflight_hits_total": "inflight_hits",
    "kvtier_kv_tier_write_queue_dropped_total": "write_queue_dropped",
    "kvtier_kv_tier_write_present_total": "write_present",
    "kvtier_kv_tier_placement_skipped_total": "placement_skipped",
    "kvtier_kv_tier_resave_bypassed_total": "resave_bypassed",
    "kvtier_kv_tier_write_queue_blocks": "write_queue_depth",
    "kvtier_kv_tier_mover_queue_batches": "queue_batches",
    "kvtier_kv_tier_consecutive_failures": "consecutive_failures",
    "kvtier_kv_tier_read_seconds": "read_seconds",
    "kvtier_kv_tier_write_seconds": "write_seconds",
}
# Strategies always exported (0 until used), so rate() has a series from the start.
_STRATEGIES = (Strategy.RECOMPUTE, Strategy.LOAD_PREFIX, Strategy.OVERLAP)
_KINDS = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "histogram": HistogramMetricFamily,
    "summary": SummaryMetricFamily,
}
Rows = list[tuple[tuple[str, ...], Any]]  # (label values after model_name, value)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _connector(stats: Mapping[str, Any], key: str) -> float:
    top = stats.get(f"kv_{key}_total")
    return _num(top if top is not None else stats.get("kv", {}).get(key, 0))


def _histogram_buckets(hist: Mapping[str, Any]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs from a ``LatencyHistogram`` snapshot."""
    out, total = [], 0.0
    for bound, count in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
        total += count
        out.append((floatToGoString(bound), total))
    return out


def _rows(stats: Mapping[str, Any]) -> dict[str, Rows]:
    """Every snapshot family's samples (an empty list: the family has no sample now)."""
    kv: Mapping[str, Any] = stats.get("kv", {})
    store_rows = tier_rows(stats)
    out: dict[str, Rows] = {f: [((), _num(stats.get(k, 0)))] for f, k in _ENGINE.items()}
    out.update({f: [((), _connector(stats, k))] for f, k in _CONNECTOR.items()})
    out["kvtier_kv_offload_enabled"] = [((), float("store" in kv))]
    gpu = stats.get("kv_gpu_hit_tokens_total", kv.get("gpu_hit_tokens"))
    if gpu is None:
        gpu = stats.get("prefix_cache_hit_tokens_total", 0)
    cached: Rows = [(("gpu",), _num(gpu))]
    block_tokens = kv.get("cost_model", {}).get("block_tokens")
    if block_tokens:
        for tier, row in kv.get("tiers", {}).items():
            cached.append(((str(tier),), _num(row.get("hit_blocks", 0)) * block_tokens))
    out["kvtier_prompt_tokens_cached_by_tier_total"] = cached
    decisions = {s: 0 for s in _STRATEGIES} | dict(kv.get("decisions", {}))
    out["kvtier_kv_decisions_total"] = [((str(k),), _num(v)) for k, v in decisions.items()]
    out["kvtier_kv_load_seconds"] = [
        ((), (_connector(stats, "num_loads"), _connector(stats, "load_seconds")))
    ]
    store = kv.get("store", {})
    out["kvtier_kv_store_in_flight_blocks"] = [((), _num(store.get("in_flight_stores", 0)))]
    out["kvtier_kv_store_load_pins"] = [((), _num(store.get("load_pins", 0)))]
    for family, key in _TIER_ROW.items():
        out[family] = [
            ((str(r["name"]),), r[key] if isinstance(r.get(key), Mapping) else _num(r.get(key, 0)))
            for r in store_rows
            if key in r
        ]
    cost = kv.get("cost_model", {})
    names = {str(r["name"]) for r in store_rows}
    priced = [(t, e) for t, e in cost.get("tiers", {}).items() if t in names]
    out["kvtier_kv_cost_model_tier_latency_seconds"] = [
        ((t,), _num(e.get("latency_s"))) for t, e in priced
    ]
    out["kvtier_kv_cost_model_tier_bandwidth_bytes_per_second"] = [
        ((t,), _num(e.get("bandwidth_bytes_per_s"))) for t, e in priced
    ]
    out["kvtier_kv_cost_model_outcome_ratio"] = [
        ((str(s),), _num(r.get("all"))) for s, r in cost.get("outcome_ratios", {}).items()
    ]
    prefill = cost.get("prefill", {})
    out["kvtier_kv_cost_model_prefill_fixed_seconds"] = [((), _num(prefill.get("fixed_s")))]
    out["kvtier_kv_cost_model_prefill_per_token_seconds"] = [((), _num(prefill.get("per_token_s")))]
    out["kvtier_kv_cost_model_predicted_saved_seconds_total"] = [
        ((), _num(cost.get("predicted_saved_s")))
    ]
    return out


def _family(f: Family, model: str, rows: Rows) -> Metric:
    metric = _KINDS[f.kind](f.name, f.help, labels=["model_name", *f.labels], unit=f.unit)
    for labels, value in rows:
        values = [model, *labels]
        if f.kind == "histogram":
            metric.add_metric(values, _histogram_buckets(value), sum_value=_num(value["sum"]))
        elif f.kind == "summary":
            metric.add_metric(values, count_value=value[0], sum_value=value[1])
        else:
            metric.add_metric(values, value)
    return metric


def snapshot_families(stats: Mapping[str, Any], model: str) -> Iterator[Metric]:
    """Every family of ``SNAPSHOT_FAMILIES``, in declaration order, from ``stats``. Missing
    values read as 0 (unlabelled families) or no sample (labelled ones). Pure."""
    rows = _rows(stats)
    for f in SNAPSHOT_FAMILIES:
        yield _family(f, model, rows[f.name])
