"""Every Prometheus family of ``kvtier serve``'s ``/metrics``, declared once: name, type, unit,
labels, help. The set never depends on the mode: without ``--kv-offload`` the offload families
are still exported (unlabelled ones as 0, per-tier ones with no sample), so dashboards and
alerts see one schema. docs/metrics.md is the table of these, with each family's source and
its vLLM equivalent.

Names follow Prometheus conventions: counters end ``_total``; units are base units as a
suffix (``_seconds``, ``_bytes``, ``_ratio``); vLLM's names (``kvtier_`` for ``vllm:``) where
the concept is vLLM's. Every sample also carries ``model_name`` (not listed in ``labels``).

``REQUEST_FAMILIES`` are recorded by the API as requests flow (engine.server.metrics);
``SNAPSHOT_FAMILIES`` are read from the engine's stats snapshot at scrape time
(engine.server.stats_export). Pure data; no registry is touched here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram", "summary"]


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as exposed: a counter's ends with _total; a histogram's has no _bucket
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # the name's unit suffix (before _total), "" for counts

    def __post_init__(self) -> None:
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: only counters end in _total")
        if self.unit and not self.name.removesuffix("_total").endswith("_" + self.unit):
            raise ValueError(f"{self.name}: the name must end with its unit {self.unit!r}")


def _c(name: str, doc: str, *labels: str, unit: str = "") -> Family:
    return Family(name, "counter", doc, labels, unit)


def _g(name: str, doc: str, *labels: str, unit: str = "") -> Family:
    return Family(name, "gauge", doc, labels, unit)


def _h(name: str, doc: str, *labels: str, unit: str = "") -> Family:
    return Family(name, "histogram", doc, labels, unit)


REQUEST_FAMILIES = (
    _c("kvtier_requests_total", "HTTP requests by endpoint and status code", "endpoint", "status"),
    _c(
        "kvtier_request_success_total",
        "Requests finished, by finish reason (stop, length, abort)",
        "finished_reason",
    ),
    _h(
        "kvtier_time_to_first_token_seconds",
        "Request arrival to its first generated token",
        unit="seconds",
    ),
    _h(
        "kvtier_inter_token_latency_seconds",
        "Time between consecutive tokens of one request",
        unit="seconds",
    ),
    _h("kvtier_e2e_request_latency_seconds", "Request arrival to its last token", unit="seconds"),
    _h(
        "kvtier_request_queue_time_seconds",
        "A request's wait in the core's queue: its arrival there to when it could first compute",
        unit="seconds",
    ),
    _h(
        "kvtier_request_prefill_time_seconds",
        "A request's prefill: when it could first compute to its first token",
        unit="seconds",
    ),
    _h(
        "kvtier_request_inference_time_seconds",
        "A request's prefill and decode: when it could first compute to its last token",
        unit="seconds",
    ),
    _h(
        "kvtier_request_decode_time_seconds",
        "A request's first token to its last (requests of two tokens or more)",
        unit="seconds",
    ),
    _h(
        "kvtier_request_time_per_output_token_seconds",
        "A request's decode time over its tokens after the first (two tokens or more)",
        unit="seconds",
    ),
    _h(
        "kvtier_request_ttft_phase_seconds",
        "Per-request TTFT phase (engine/ttft.py)",
        "phase",
        unit="seconds",
    ),
    _h("kvtier_request_prompt_tokens", "Prompt tokens of each finished request"),
    _h("kvtier_request_generation_tokens", "Generated tokens of each finished request"),
)

_T = "tier"
SNAPSHOT_FAMILIES = (
    # The engine core: scheduler and GPU prefix cache.
    _g("kvtier_num_requests_running", "Requests being scheduled"),
    _g("kvtier_num_requests_waiting", "Requests waiting to be scheduled (or for their KV)"),
    _c("kvtier_prompt_tokens_total", "Prompt tokens processed (prefill, cached tokens included)"),
    _c("kvtier_generation_tokens_total", "Tokens generated"),
    _c("kvtier_prefix_cache_queries_total", "Prompt tokens looked up in the GPU prefix cache"),
    _c("kvtier_prefix_cache_hits_total", "Prompt tokens found in the GPU prefix cache"),
    _c("kvtier_num_preemptions_total", "Requests preempted for lack of GPU blocks"),
    _c(
        "kvtier_scheduler_released_loads_total",
        "Loading requests whose blocks went to running work (load cancelled, request waits again)",
    ),
    _g("kvtier_gpu_cache_usage_ratio", "Fraction of GPU KV blocks in use (0-1)", unit="ratio"),
    _g("kvtier_gpu_cache_blocks", "KV blocks in the GPU pool"),
    _g("kvtier_gpu_cache_free_blocks", "GPU KV blocks free or cached-evictable"),
    _c("kvtier_scheduler_steps_total", "Steps the scheduler decided"),
    _c("kvtier_scheduler_seconds_total", "The scheduler's own time deciding steps", unit="seconds"),
    _c(
        "kvtier_scheduler_blocked_skips_total",
        "Steps in which the head of the queue waited for GPU blocks (not looked up again)",
    ),
    _c(
        "kvtier_scheduler_first_token_deferred_tokens_total",
        "Prefill tokens deferred so that a step could yield a short prefill's first token",
    ),
    _c(
        "kvtier_scheduler_load_wait_deferred_tokens_total",
        "Prefill tokens deferred so that a step ended soon after a waiting request's KV load",
    ),
    _c(
        "kvtier_prompt_tokens_cached_by_tier_total",
        "Prompt tokens whose KV came from a tier at admission (gpu: the prefix cache)",
        _T,
    ),
    # The KV offload connector (0 without --kv-offload).
    _g("kvtier_kv_offload_enabled", "1 when the engine runs the KV offload connector"),
    _c("kvtier_kv_loaded_tokens_total", "Prompt tokens whose KV was loaded from the tiers"),
    _c(
        "kvtier_kv_recomputed_tokens_total",
        "Prompt tokens the tiers held but that were computed (decision, or a failed load)",
    ),
    _c("kvtier_kv_overlap_head_tokens_total", "Tokens computed while an overlap's tail loaded"),
    _c("kvtier_kv_overlaps_total", "Admissions that overlapped computing a head with a load"),
    _c(
        "kvtier_kv_decisions_total",
        "Reload-versus-recompute decisions applied, by strategy",
        "decision",
    ),
    Family(
        "kvtier_kv_load_seconds",
        "summary",
        "Asynchronous KV loads: count and seconds",
        unit="seconds",
    ),
    _c("kvtier_kv_loaded_blocks_total", "KV blocks loaded from the tiers"),
    _c("kvtier_kv_loaded_bytes_total", "KV payload bytes loaded from the tiers", unit="bytes"),
    _c("kvtier_kv_failed_loads_total", "Loads that came back short (missing, corrupt, tier down)"),
    _c("kvtier_kv_timed_out_loads_total", "Loads abandoned after the load timeout"),
    _c("kvtier_kv_cancelled_loads_total", "Loads cancelled (request aborted while loading)"),
    _c("kvtier_kv_lookups_total", "Tier lookups made to admit requests"),
    _c(
        "kvtier_kv_lookup_blocks_total",
        "Blocks those lookups asked about (over kvtier_kv_loaded_blocks_total: lookups per loaded block)",
    ),
    _c(
        "kvtier_kv_prefetched_blocks_total",
        "Blocks read up into the host tier while their request waited (prefetch on arrival)",
    ),
    _c("kvtier_kv_prefetch_used_blocks_total", "Prefetched blocks their request then loaded"),
    _c(
        "kvtier_kv_prefetch_wasted_blocks_total",
        "Prefetched blocks released unused (request gone first, or loaded fewer)",
    ),
    _c(
        "kvtier_kv_in_step_deferred_loads_total",
        "Host loads made async because their step already had its in-step loads",
    ),
    _c(
        "kvtier_kv_shared_step_decisions_total",
        "Cost decisions made with no overlap split offered: the last step computed other prompts",
    ),
    _c(
        "kvtier_kv_shared_step_outcomes_total",
        "Plan outcomes taught to the cost model whose steps carried other requests' tokens",
    ),
    _c(
        "kvtier_kv_backlog_decisions_total",
        "Cost decisions priced behind other loads' reads queued on the load thread",
    ),
    _g(
        "kvtier_kv_load_backlog_blocks",
        "Blocks below the host tier that async loads in flight still read on the load thread",
    ),
    _c("kvtier_kv_saved_blocks_total", "KV blocks saved to the tiers"),
    _c("kvtier_kv_saved_bytes_total", "KV payload bytes saved to the tiers", unit="bytes"),
    _c("kvtier_kv_save_seconds_total", "Seconds spent saving KV batches", unit="seconds"),
    _c("kvtier_kv_save_skipped_blocks_total", "Blocks not saved: the store already held them"),
    _c(
        "kvtier_kv_save_incompressible_blocks_total",
        "Blocks not saved: lossless compression could not encode them",
    ),
    _g("kvtier_kv_store_in_flight_blocks", "Blocks claimed for a save and not yet written"),
    _g("kvtier_kv_store_load_pins", "Block pins held for loads in flight (all tiers)"),
    # The store's tiers (one `tier` label value per configured tier; none without offload).
    _c("kvtier_kv_tier_hits_total", "Blocks found in this tier", _T),
    _c("kvtier_kv_tier_misses_total", "Blocks asked of this tier and not found", _T),
    _c("kvtier_kv_tier_read_bytes_total", "Encoded bytes read from this tier", _T, unit="bytes"),
    _c(
        "kvtier_kv_tier_written_bytes_total", "Encoded bytes written to this tier", _T, unit="bytes"
    ),
    _h(
        "kvtier_kv_tier_read_seconds",
        "One batched read of this tier (retrieve)",
        _T,
        unit="seconds",
    ),
    _h(
        "kvtier_kv_tier_write_seconds", "One batched write to this tier (store)", _T, unit="seconds"
    ),
    _c("kvtier_kv_tier_errors_total", "Tier failures (degraded to misses or skipped writes)", _T),
    _c("kvtier_kv_tier_corrupt_total", "Values that failed to decode (counted as misses)", _T),
    _c("kvtier_kv_tier_skipped_total", "Calls skipped while the tier backed off", _T),
    _c("kvtier_kv_tier_evictions_total", "Entries evicted from this tier", _T),
    _c("kvtier_kv_tier_demoted_total", "Evictions copied out and queued for the tier below", _T),
    _c("kvtier_kv_tier_demotions_dropped_total", "Evictions not demoted to the next tier", _T),
    _c("kvtier_kv_tier_dropped_at_bottom_total", "Evictions of the last tier: gone for good", _T),
    _c("kvtier_kv_tier_promotions_total", "Blocks queued for promotion from this tier", _T),
    _c("kvtier_kv_tier_promotions_dropped_total", "Promotions dropped (queue full)", _T),
    _c("kvtier_kv_tier_written_through_total", "Blocks copied here by write-through", _T),
    _c("kvtier_kv_tier_written_back_total", "Blocks written here on eviction above or flush", _T),
    _c("kvtier_kv_tier_inflight_hits_total", "Reads of blocks queued here, not yet written", _T),
    _c("kvtier_kv_tier_write_queue_dropped_total", "Blocks dropped from a full write queue", _T),
    _c("kvtier_kv_tier_write_present_total", "Blocks not rewritten: the tier held them", _T),
    _c(
        "kvtier_kv_tier_resave_bypassed_total",
        "Blocks a lower tier held, not saved here again: such re-saves were evicted unread",
        _T,
    ),
    _c(
        "kvtier_kv_tier_placement_skipped_total",
        "Blocks not demoted here: no prefix would be worth loading from it",
        _T,
    ),
    _g(
        "kvtier_kv_tier_write_queue_blocks", "Blocks waiting in this tier's write-through queue", _T
    ),
    _g("kvtier_kv_tier_mover_queue_batches", "Batches waiting in this tier's demotion queue", _T),
    _g("kvtier_kv_tier_consecutive_failures", "Consecutive failures (0: healthy)", _T),
    # The cost model's live estimates (cost-based decisions; no sample without offload).
    _g(
        "kvtier_kv_cost_model_tier_latency_seconds",
        "Estimated latency of one read",
        _T,
        unit="seconds",
    ),
    _g(
        "kvtier_kv_cost_model_tier_bandwidth_bytes_per_second",
        "Estimated read bandwidth",
        _T,
        unit="bytes_per_second",
    ),
    _g(
        "kvtier_kv_cost_model_outcome_ratio",
        "Measured over priced time of served plans, by strategy (1: priced as is)",
        "decision",
    ),
    _g(
        "kvtier_kv_cost_model_prefill_fixed_seconds",
        "Estimated fixed cost of one prefill",
        unit="seconds",
    ),
    _g(
        "kvtier_kv_cost_model_prefill_per_token_seconds",
        "Estimated prefill cost per token",
        unit="seconds",
    ),
    _c(
        "kvtier_kv_cost_model_predicted_saved_seconds_total",
        "Predicted seconds saved by the cost model's decisions against recomputing",
        unit="seconds",
    ),
)

ALL_FAMILIES = (*REQUEST_FAMILIES, *SNAPSHOT_FAMILIES)
BY_NAME = {f.name: f for f in ALL_FAMILIES}
if len(BY_NAME) != len(ALL_FAMILIES):
    raise RuntimeError("duplicate metric family name")

_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
}


def sample_names() -> frozenset[str]:
    """Every sample name /metrics can carry (a histogram's ``_bucket``, ``_sum`` ...): what a
    dashboard or an alert may query."""
    out = set()
    for f in ALL_FAMILIES:
        base = f.name.removesuffix("_total")
        for suffix in _SUFFIXES[f.kind]:
            out.add(f.name if suffix == "" else base + suffix)
    return frozenset(out)


# ``kvtier serve --vllm-metric-names``: the families whose meaning is vLLM's, exported a second
# time under vLLM 0.32's names (same type, labels and values), for the routers, autoscalers and
# dashboards written against vLLM's ``/metrics`` (the production-stack router, KEDA rules,
# Grafana boards). Only one-to-one equivalents; docs/metrics.md lists the rest.
VLLM_NAMES: dict[str, str] = {
    "kvtier_request_success_total": "vllm:request_success_total",
    "kvtier_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "kvtier_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "kvtier_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "kvtier_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "kvtier_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "kvtier_request_inference_time_seconds": "vllm:request_inference_time_seconds",
    "kvtier_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "kvtier_request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "kvtier_request_prompt_tokens": "vllm:request_prompt_tokens",
    "kvtier_request_generation_tokens": "vllm:request_generation_tokens",
    "kvtier_num_requests_running": "vllm:num_requests_running",
    "kvtier_num_requests_waiting": "vllm:num_requests_waiting",
    "kvtier_prompt_tokens_total": "vllm:prompt_tokens_total",
    "kvtier_generation_tokens_total": "vllm:generation_tokens_total",
    "kvtier_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "kvtier_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "kvtier_num_preemptions_total": "vllm:num_preemptions_total",
    "kvtier_gpu_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # vLLM's is 0-1 too
    "kvtier_kv_loaded_tokens_total": "vllm:external_prefix_cache_hits_total",
}
for _ours, _theirs in VLLM_NAMES.items():
    if _ours not in BY_NAME or _ours.endswith("_total") != _theirs.endswith("_total"):
        raise RuntimeError(f"bad vLLM alias {_ours} -> {_theirs}")
