"""What one configuration of the stack hits and saves, and how that moves with one tier's size.

One point is ``run_stack`` (the stack as given) -> ``ratios`` (each tier's share of the block
references, the total block and token hit ratios) and ``savings`` (the cost model's seconds;
``NET_SAVED_DEFINITION`` says what "net saved" is). ``sweep`` evaluates a point with one tier at each ``--sweep`` capacity and the others fixed, so a
stack ending in an unbounded tier shows the upper tiers' shares move while the total stays;
``tier_curves`` does the same for every tier over a log-spaced grid (what the per-tier plots
draw). All-LRU stacks are exact from the stack distances (``simulate.lru_hierarchy``, a few ms
a point); any other policy replays each point (``simulate.replay``). Pure computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachestore.analyze.config import AnalyzeConfig
from cachestore.analyze.simulate import ProgressFn, ReplayResult, TierSpec, lru_hierarchy, replay
from cachestore.analyze.stack_distance import StackDistances
from cachestore.analyze.traces import Trace
from cachestore.cost.model import hops_to_gpu, reload_time

LRU_CURVE_POINTS = 33  # per tier, when every point is a few ms (all-LRU)
REPLAY_CURVE_POINTS = 9  # per tier, when every point is a full replay

# The one definition of "net saved", quoted by the table, the Markdown report and docs/analyze.md.
NET_SAVED_DEFINITION = (
    "net saved = sum over requests of max(saved - restore, 0), where saved = T(L) - T(L-h | h) "
    "is the prefill GPU time the request's h leading hit tokens avoid (cost model, prompt of L "
    "tokens) and restore is the time to reload those hit blocks from the tiers holding them "
    "(latency + bytes / bandwidth of each tier's hops to the GPU); a request whose reload would "
    "be slower than recomputing counts 0 (the engine recomputes it)"
)


def depth_values(cfg: AnalyzeConfig, trace: Trace) -> list[float]:
    """Prefill seconds saved per byte by a cached block at each depth (the cost policy's value)."""
    bt, block_bytes = trace.block_tokens, cfg.kv_bytes_per_token * trace.block_tokens
    lens = np.diff(trace.offsets)
    depth = int(lens.max()) if len(lens) else 1
    return [cfg.prefill.time(bt, d * bt) / block_bytes for d in range(max(depth, 1))]


def run_stack(
    trace: Trace,
    cfg: AnalyzeConfig,
    tiers: Sequence[TierSpec],
    sd: StackDistances,
    progress: ProgressFn | None = None,
) -> tuple[ReplayResult, str]:
    """The replay result of ``tiers`` and how it was obtained (``mattson`` or ``replay``)."""
    if all(t.policy == "lru" for t in tiers) and not cfg.force_replay:
        return lru_hierarchy(trace, sd, tiers), "mattson"
    return replay(trace, tiers, depth_values(cfg, trace), progress), "replay"


def savings(trace: Trace, cfg: AnalyzeConfig, res: ReplayResult) -> dict[str, float]:
    """Baseline prefill, prefill saved, restore time and net saved, in seconds (see
    ``NET_SAVED_DEFINITION``). Tier hops come from the tier names of ``res``."""
    bt = trace.block_tokens
    block_bytes = cfg.kv_bytes_per_token * bt
    hops = [hops_to_gpu(t.name, cfg.tier_costs) for t in res.tiers]
    hit_tokens = np.minimum(res.hit_blocks * bt, trace.input_tokens)
    baseline = saved = restore = net = 0.0
    pf = cfg.prefill
    lengths = trace.input_tokens.tolist()
    for r, (length, got) in enumerate(zip(lengths, hit_tokens.tolist(), strict=True)):
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
    return {
        "baseline_prefill_seconds": baseline,
        "saved_prefill_seconds": saved,
        "restore_seconds": restore,
        "net_saved_seconds": net,
    }


@dataclass(frozen=True, slots=True)
class HitRatios:
    """Each tier's share of the block references (top first) and the stack's totals."""

    tier_hit_ratio: tuple[float, ...]
    block_hit_ratio: float
    token_hit_ratio: float


def ratios(trace: Trace, res: ReplayResult) -> HitRatios:
    refs = max(trace.num_block_refs, 1)
    hit_tokens = int(np.minimum(res.hit_blocks * trace.block_tokens, trace.input_tokens).sum())
    return HitRatios(
        tuple(t.hit_blocks / refs for t in res.tiers),
        float(res.hit_blocks.sum() / refs),
        hit_tokens / max(int(trace.input_tokens.sum()), 1),
    )


def with_capacity(tiers: Sequence[TierSpec], idx: int, blocks: int | None) -> list[TierSpec]:
    """``tiers`` with tier ``idx`` resized to ``blocks`` (None: unbounded)."""
    out = list(tiers)
    out[idx] = TierSpec(out[idx].name, blocks, out[idx].policy)
    return out


def sweep(trace: Trace, cfg: AnalyzeConfig, sd: StackDistances) -> dict[str, object]:
    """``cfg.sweep_tier`` at each of ``cfg.sweep_capacities`` (blocks), the other tiers as
    configured: per point every tier's share, the totals and the savings. Raises ValueError
    for a tier name not in the stack."""
    names = [t.name for t in cfg.tiers]
    if cfg.sweep_tier not in names:
        raise ValueError(
            f"--sweep names tier {cfg.sweep_tier!r}, not one of the --tier names {names}"
        )
    idx = names.index(cfg.sweep_tier)
    caps = list(cfg.sweep_capacities)
    tier_hit: list[list[float]] = [[] for _ in names]
    block_ratio: list[float] = []
    token_ratio: list[float] = []
    saved: list[float] = []
    restore: list[float] = []
    net: list[float] = []
    method = "mattson"
    for c in caps:
        res, method = run_stack(trace, cfg, with_capacity(cfg.tiers, idx, c), sd)
        r, s = ratios(trace, res), savings(trace, cfg, res)
        for i, x in enumerate(r.tier_hit_ratio):
            tier_hit[i].append(x)
        block_ratio.append(r.block_hit_ratio)
        token_ratio.append(r.token_hit_ratio)
        saved.append(s["saved_prefill_seconds"])
        restore.append(s["restore_seconds"])
        net.append(s["net_saved_seconds"])
    others = [t.capacity_blocks for i, t in enumerate(cfg.tiers) if i != idx]
    fixed = None if None in others else sum(c for c in others if c is not None)
    total = [None if fixed is None or c is None else fixed + c for c in caps]
    return {
        "tier": cfg.sweep_tier,
        "capacities_blocks": caps,
        "total_capacity_blocks": total,
        "tier_hit_ratio": dict(zip(names, tier_hit, strict=True)),
        "block_hit_ratio": block_ratio,
        "token_hit_ratio": token_ratio,
        "saved_prefill_seconds": saved,
        "restore_seconds": restore,
        "net_saved_seconds": net,
        "method": method,
    }


def curve_grid(top_blocks: int, configured: int | None, points: int) -> list[int]:
    """Log-spaced capacities from 1 block to ``top_blocks`` (where every block of the trace
    fits), plus the configured one when bounded; sorted, distinct."""
    top = max(top_blocks, configured or 0, 1)
    grid = np.unique(np.round(np.logspace(0, np.log10(top), points)).astype(np.int64)).tolist()
    return sorted(set(grid) | ({configured} if configured else set()))


def tier_curves(
    trace: Trace, cfg: AnalyzeConfig, sd: StackDistances, points: int | None = None
) -> list[dict[str, object]]:
    """For each tier: its capacity over ``curve_grid`` with the other tiers as configured, and
    at each point that tier's share of the block references, the cumulative share of the
    tiers down to it and the stack's total block hit ratio."""
    exact = all(t.policy == "lru" for t in cfg.tiers) and not cfg.force_replay
    n = points or (LRU_CURVE_POINTS if exact else REPLAY_CURVE_POINTS)
    out: list[dict[str, object]] = []
    for i, tier in enumerate(cfg.tiers):
        caps = curve_grid(trace.num_unique_blocks, tier.capacity_blocks, n)
        own, cumulative, total = [], [], []
        for c in caps:
            res, _ = run_stack(trace, cfg, with_capacity(cfg.tiers, i, c), sd)
            shares = ratios(trace, res).tier_hit_ratio
            own.append(shares[i])
            cumulative.append(sum(shares[: i + 1]))
            total.append(sum(shares))
        out.append(
            {
                "tier": tier.name,
                "capacities_blocks": caps,
                "tier_hit_ratio": own,
                "cumulative_hit_ratio": cumulative,
                "total_hit_ratio": total,
                "method": "mattson" if exact else "replay",
            }
        )
    return out
