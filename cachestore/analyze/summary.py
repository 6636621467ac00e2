"""One analysis run: replay (or its LRU shortcut), curve, reuse distances and cost-model savings.

``analyze`` is the whole pipeline behind ``kvtier analyze`` and bench/analyze.py; it returns a
plain dict (the ``--json`` document, schema in docs/analyze.md) so that the report writers and
tests read the same numbers. Pure computation; the progress callback is the only side effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cachestore.analyze.simulate import ProgressFn, ReplayResult, TierSpec, lru_hierarchy, replay
from cachestore.analyze.stack_distance import COLD, StackDistances, lru_hit_curve, stack_distances
from cachestore.analyze.traces import Trace
from cachestore.cost.model import (
    DEFAULT_TIER_COSTS,
    LLAMA3_8B_H200_PREFILL,
    PrefillCost,
    TierCost,
    hops_to_gpu,
    reload_time,
)

PERCENTILES = (50, 90, 99)


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


def _nearest_rank(sorted_values: np.ndarray, pct: int) -> int | None:
    """Smallest value with at least ``pct``% of the samples at or below it."""
    if len(sorted_values) == 0:
        return None
    rank = max(1, -(-pct * len(sorted_values) // 100))
    return int(sorted_values[rank - 1])


def _depth_values(cfg: AnalyzeConfig, trace: Trace) -> list[float]:
    """Prefill seconds saved per byte by a cached block at each depth (the cost policy's value)."""
    bt, block_bytes = trace.block_tokens, cfg.kv_bytes_per_token * trace.block_tokens
    lens = np.diff(trace.offsets)
    depth = int(lens.max()) if len(lens) else 1
    return [cfg.prefill.time(bt, d * bt) / block_bytes for d in range(max(depth, 1))]


def _run(trace: Trace, cfg: AnalyzeConfig, tiers: Sequence[TierSpec],
         sd: StackDistances, progress: ProgressFn | None) -> tuple[ReplayResult, str]:
    if all(t.policy == "lru" for t in tiers) and not cfg.force_replay:
        return lru_hierarchy(trace, sd, tiers), "mattson"
    return replay(trace, tiers, _depth_values(cfg, trace), progress), "replay"


def _savings(trace: Trace, cfg: AnalyzeConfig, res: ReplayResult) -> dict[str, float]:
    bt = trace.block_tokens
    block_bytes = cfg.kv_bytes_per_token * bt
    hops = [hops_to_gpu(t.name, cfg.tier_costs) for t in cfg.tiers]
    hit_tokens = np.minimum(res.hit_blocks * bt, trace.input_tokens)
    baseline = saved = restore = net = 0.0
    pf = cfg.prefill
    for r, (length, got) in enumerate(zip(trace.input_tokens.tolist(), hit_tokens.tolist(), strict=True)):
        full = pf.time(length, 0)
        baseline += full
        if got == 0:
            continue
        s = full - pf.time(length - got, got)
        row = res.tier_hit_blocks[r]
        t = sum(reload_time(int(n), block_bytes, hops[i]) for i, n in enumerate(row) if n)
        saved += s
        restore += t
        net += max(s - t, 0.0)  # the engine recomputes when reloading would be slower
    return {"baseline_prefill_seconds": baseline, "saved_prefill_seconds": saved,
            "restore_seconds": restore, "net_saved_seconds": net}


def _sweep(trace: Trace, cfg: AnalyzeConfig, sd: StackDistances) -> dict[str, object]:
    idx = next((i for i, t in enumerate(cfg.tiers) if t.name == cfg.sweep_tier), None)
    if idx is None:
        raise ValueError(f"--sweep names tier {cfg.sweep_tier!r}, not one of the --tier names")
    caps = list(cfg.sweep_capacities)
    others = [t.capacity_blocks for i, t in enumerate(cfg.tiers) if i != idx]
    block_ratio, token_ratio = [], []
    all_lru = all(t.policy == "lru" for t in cfg.tiers)
    if all_lru and not cfg.force_replay:
        # One Mattson pass: an LRU hierarchy hits like one LRU cache of the summed capacity.
        unbounded = None in others
        totals = [trace.num_block_refs + 1 if unbounded or c is None else sum(others) + c
                  for c in caps]
        curve = lru_hit_curve(trace, np.asarray(totals, np.int64), sd)
        block_ratio, token_ratio = curve.block_hit_ratio.tolist(), curve.token_hit_ratio.tolist()
        method = "mattson"
    else:
        for c in caps:
            tiers = list(cfg.tiers)
            tiers[idx] = TierSpec(tiers[idx].name, c, tiers[idx].policy)
            res = replay(trace, tiers, _depth_values(cfg, trace))
            hb = res.hit_blocks
            block_ratio.append(float(hb.sum() / max(trace.num_block_refs, 1)))
            ht = np.minimum(hb * trace.block_tokens, trace.input_tokens).sum()
            token_ratio.append(float(ht / max(trace.input_tokens.sum(), 1)))
        method = "replay"
    fixed = None if None in others else sum(others)
    total = [None if fixed is None or c is None else fixed + c for c in caps]
    return {"tier": cfg.sweep_tier, "capacities_blocks": caps, "total_capacity_blocks": total,
            "block_hit_ratio": block_ratio,
            "token_hit_ratio": token_ratio, "method": method}


def analyze(trace: Trace, cfg: AnalyzeConfig, progress: ProgressFn | None = None,
            keep_distances: bool = False) -> dict[str, object]:
    """The full analysis document (see docs/analyze.md). Raises ValueError on a bad config."""
    sd = stack_distances(trace)
    res, method = _run(trace, cfg, cfg.tiers, sd, progress)
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
        "infinite_capacity": {"block_hit_ratio": float(inf_curve.block_hit_ratio[0]),
                              "token_hit_ratio": float(inf_curve.token_hit_ratio[0])},
        "method": method,
        "model_profile": cfg.model_profile,
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "kv_compression": cfg.kv_compression,
        "block_bytes": block_bytes,
        "tiers": [
            {"name": t.name, "policy": t.policy, "capacity_blocks": t.capacity_blocks,
             "hit_blocks": t.hit_blocks, "read_bytes": t.hit_blocks * block_bytes,
             "write_bytes": t.inserted_blocks * block_bytes, "inserted_blocks": t.inserted_blocks,
             "evicted_blocks": t.evicted_blocks, "resident_blocks": t.resident_blocks}
            for t in res.tiers
        ],
        "reuse_distance": {f"p{p}": _nearest_rank(reuse, p) for p in PERCENTILES}
        | {"reuse_refs": int(len(reuse)), "cold_refs": int(trace.num_block_refs - len(reuse))},
        "cost_model": {"prefill": {"fixed_s": cfg.prefill.fixed_s,
                                   "per_token_s": cfg.prefill.per_token_s,
                                   "attention_s": cfg.prefill.attention_s},
                       "tiers": {t.name: [{"name": h.name, "latency_s": h.latency_s,
                                           "bandwidth_bytes_per_s": h.bandwidth_bytes_per_s}
                                          for h in hops_to_gpu(t.name, cfg.tier_costs)]
                                 for t in cfg.tiers}},
    }
    doc |= _savings(trace, cfg, res)
    # The exact single-LRU curve at log-spaced capacities up to every block fitting: free once
    # the distances exist, and what the plot and the Mooncake comparison read.
    top = max(trace.num_unique_blocks, 1)
    caps = np.unique(np.round(np.logspace(0, np.log10(top), 48)).astype(np.int64))
    curve = lru_hit_curve(trace, caps, sd)
    doc["lru_curve"] = {"capacities_blocks": caps.tolist(),
                        "block_hit_ratio": curve.block_hit_ratio.tolist(),
                        "token_hit_ratio": curve.token_hit_ratio.tolist()}
    if cfg.sweep_tier is not None:
        doc["sweep"] = _sweep(trace, cfg, sd)
    if keep_distances:
        doc["_reuse_distances"] = reuse  # for the CDF plot; not written to JSON
    return doc
