"""One analysis run: replay (or its LRU shortcut), curve, reuse distances and cost-model savings.

``analyze`` is the whole pipeline behind ``kvtier analyze`` and bench/analyze.py; it returns a
plain dict (the ``--json`` document, schema in docs/analyze.md) so that the report writers and
tests read the same numbers. Pure computation; the progress callback is the only side effect.
"""

from __future__ import annotations

import numpy as np

from cachestore.analyze.config import AnalyzeConfig, as_written
from cachestore.analyze.simulate import ProgressFn, ReplayResult
from cachestore.analyze.stack_distance import COLD, StackDistances, lru_hit_curve, stack_distances
from cachestore.analyze.sweeps import NET_SAVED_DEFINITION, run_stack, savings, sweep, tier_curves
from cachestore.analyze.traces import Trace
from cachestore.cost.model import hops_to_gpu
from tiers.sizes import Size

__all__ = ["AnalyzeConfig", "analyze"]
PERCENTILES = (50, 90, 99)


def _nearest_rank(sorted_values: np.ndarray, pct: int) -> int | None:
    """Smallest value with at least ``pct``% of the samples at or below it."""
    if len(sorted_values) == 0:
        return None
    rank = max(1, -(-pct * len(sorted_values) // 100))
    return int(sorted_values[rank - 1])


def analyze(
    trace: Trace,
    cfg: AnalyzeConfig,
    progress: ProgressFn | None = None,
    keep_distances: bool = False,
    curves: bool = False,
) -> dict[str, object]:
    """The full analysis document (see docs/analyze.md). ``curves``: also each tier's hit
    ratios over its capacity (``tier_curves``, what the plot draws; a replay per point unless
    every tier is LRU). Raises ValueError on a bad config."""
    sd = stack_distances(trace)
    res, method = run_stack(trace, cfg, cfg.tiers, sd, progress)
    written = as_written(cfg.tier_sizes, [t.capacity_blocks for t in cfg.tiers])
    bt = trace.block_tokens
    block_bytes = cfg.kv_bytes_per_token * bt
    total_tokens = int(trace.input_tokens.sum())
    hit_blocks = int(res.hit_blocks.sum())
    hit_tokens = int(np.minimum(res.hit_blocks * bt, trace.input_tokens).sum())
    reuse = np.sort(sd.distance[sd.distance != COLD])
    inf_curve = lru_hit_curve(trace, [trace.num_block_refs + 1], sd)
    doc: dict[str, object] = {
        "format": trace.format,
        "block_tokens": bt,
        "requests": trace.num_requests,
        "block_refs": trace.num_block_refs,
        "unique_blocks": trace.num_unique_blocks,
        "input_tokens": total_tokens,
        "hit_blocks": hit_blocks,
        "hit_tokens": hit_tokens,
        "block_hit_ratio": hit_blocks / max(trace.num_block_refs, 1),
        "token_hit_ratio": hit_tokens / max(total_tokens, 1),
        "infinite_capacity": {
            "block_hit_ratio": float(inf_curve.block_hit_ratio[0]),
            "token_hit_ratio": float(inf_curve.token_hit_ratio[0]),
        },
        "method": method,
        "model_profile": cfg.model_profile,
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "kv_compression": cfg.kv_compression,
        "block_bytes": block_bytes,
        "tiers": _tier_rows(res, written, block_bytes),
        "reuse_distance": {f"p{p}": _nearest_rank(reuse, p) for p in PERCENTILES}
        | {"reuse_refs": int(len(reuse)), "cold_refs": int(trace.num_block_refs - len(reuse))},
        "cost_model": _cost_model(cfg),
    }
    doc |= savings(trace, cfg, res)
    doc["net_saved_definition"] = NET_SAVED_DEFINITION
    # The exact single-LRU curve at log-spaced capacities up to every block fitting: free once
    # the distances exist, and what the plot and the Mooncake comparison read.
    doc["lru_curve"] = _lru_curve(trace, sd)
    if cfg.sweep_tier is not None:
        doc["sweep"] = _sweep(trace, cfg, sd)
    if curves:
        doc["tier_curves"] = tier_curves(trace, cfg, sd)
    if keep_distances:
        doc["_reuse_distances"] = reuse  # for the CDF plot; not written to JSON
    return doc


def _sweep(trace: Trace, cfg: AnalyzeConfig, sd: StackDistances) -> dict[str, object]:
    """The document's ``sweep`` (``sweeps.sweep``), each capacity as written too."""
    sw = sweep(trace, cfg, sd)
    pts = as_written(cfg.sweep_sizes, sw["capacities_blocks"])  # type: ignore[arg-type]
    return sw | {
        "capacities_text": [p.text for p in pts],
        "capacities_unit": [p.unit for p in pts],
    }


def _tier_rows(res: ReplayResult, written: list[Size], block_bytes: int) -> list[dict[str, object]]:
    """The document's ``tiers``: what each tier did, in blocks and bytes."""
    return [
        {
            "name": t.name,
            "policy": t.policy,
            "capacity_blocks": t.capacity_blocks,
            "capacity_text": w.text,
            "capacity_unit": w.unit,
            "hit_blocks": t.hit_blocks,
            "read_bytes": t.hit_blocks * block_bytes,
            "write_bytes": t.inserted_blocks * block_bytes,
            "inserted_blocks": t.inserted_blocks,
            "evicted_blocks": t.evicted_blocks,
            "resident_blocks": t.resident_blocks,
        }
        for t, w in zip(res.tiers, written, strict=True)
    ]


def _cost_model(cfg: AnalyzeConfig) -> dict[str, object]:
    """The document's ``cost_model``: the prefill model and each tier's hops to the GPU."""
    return {
        "prefill": {
            "fixed_s": cfg.prefill.fixed_s,
            "per_token_s": cfg.prefill.per_token_s,
            "attention_s": cfg.prefill.attention_s,
        },
        "tiers": {
            t.name: [
                {
                    "name": h.name,
                    "latency_s": h.latency_s,
                    "bandwidth_bytes_per_s": h.bandwidth_bytes_per_s,
                }
                for h in hops_to_gpu(t.name, cfg.tier_costs)
            ]
            for t in cfg.tiers
        },
    }


def _lru_curve(trace: Trace, sd: StackDistances) -> dict[str, object]:
    """The single-LRU hit curve at 48 log-spaced capacities up to every block fitting."""
    top = max(trace.num_unique_blocks, 1)
    caps = np.unique(np.round(np.logspace(0, np.log10(top), 48)).astype(np.int64))
    curve = lru_hit_curve(trace, caps, sd)
    return {
        "capacities_blocks": caps.tolist(),
        "block_hit_ratio": curve.block_hit_ratio.tolist(),
        "token_hit_ratio": curve.token_hit_ratio.tolist(),
    }
