"""`kvtier analyze` speed beside LMCache's cache simulator, on the same trace in the same run.

The peer is ``lmcache.tools.cache_simulator.simulator.simulate`` (``pip install --no-deps lmcache
sortedcontainers``), fed the trace converted to its lookup-hash events (``chunk_hashes`` =
``hash_ids``, ``seq_len`` = ``input_length``, ``chunk_size`` = block tokens). Timed, best of
``--repeat`` interleaved runs, each from a parsed trace in memory:

    lmcache full   simulate(fast=False): one capacity, its full statistics
    lmcache fast   simulate(fast=True): one capacity, hit rate only
    kvtier report  summary.analyze: two LRU tiers, reuse distances, per-tier bytes, cost-model
                   savings, the 48-point LRU curve
    kvtier curve   lru_hit_curve at every capacity 0..unique blocks (Mattson, one pass)

Ratios below 1 mean kvtier is faster. Also checks that both tools count the same leading-hit
blocks at that capacity. Prints one JSON document and a one-line summary.

    .venv/bin/python bench/analyze.py [--trace tests/data/traces/conversation_trace.jsonl.gz]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_info  # noqa: E402
from cachestore.analyze.simulate import TierSpec  # noqa: E402
from cachestore.analyze.stack_distance import lru_hit_curve  # noqa: E402
from cachestore.analyze.summary import AnalyzeConfig, analyze  # noqa: E402
from cachestore.analyze.traces import open_text, read_trace  # noqa: E402
from cachestore.cost.model import get_model_profile  # noqa: E402

DEFAULT_TRACE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "tests",
    "data",
    "traces",
    "conversation_trace.jsonl.gz",
)


def _timed(fn: Callable[[], Any], times: list[float]) -> Any:
    """Run ``fn`` once, append its wall time to ``times``, return its result."""
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
    return out


def _lmcache_events(path: str, block_tokens: int) -> list[dict[str, Any]] | None:
    try:
        from lmcache.tools.cache_simulator import simulator  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "peer unavailable"
        return None
    events = []
    with open_text(path) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                events.append(
                    {
                        "timestamp": r["timestamp"],
                        "chunk_hashes": r["hash_ids"],
                        "seq_len": r["input_length"],
                        "chunk_size": block_tokens,
                    }
                )
    events.sort(key=lambda e: e["timestamp"])
    return events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--capacity-blocks", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    read_s = time.perf_counter() - t0
    bt = trace.block_tokens
    kv = get_model_profile("llama-3-8b").kv_bytes_per_token
    half = args.capacity_blocks // 2
    cfg = AnalyzeConfig(
        tiers=(TierSpec("host", half), TierSpec("lmdb", args.capacity_blocks - half)),
        kv_bytes_per_token=kv,
        model_profile="llama-3-8b",
    )
    all_caps = np.arange(trace.num_unique_blocks + 1)
    events = _lmcache_events(args.trace, bt)
    chunk_bytes = kv * bt
    times: dict[str, list[float]] = {
        k: [] for k in ("lmcache_full", "lmcache_fast", "kvtier_report", "kvtier_curve")
    }
    lm_full = doc = None
    for _ in range(args.repeat):  # interleaved, so that load from other processes hits all alike
        if events is not None:
            from lmcache.tools.cache_simulator.simulator import simulate

            lm_full = _timed(
                lambda: simulate(
                    events, args.capacity_blocks * chunk_bytes, chunk_bytes, fast=False
                ),
                times["lmcache_full"],
            )
            _timed(
                lambda: simulate(
                    events, args.capacity_blocks * chunk_bytes, chunk_bytes, fast=True
                ),
                times["lmcache_fast"],
            )
        doc = _timed(lambda: analyze(trace, cfg), times["kvtier_report"])
        curve = _timed(lambda: lru_hit_curve(trace, all_caps), times["kvtier_curve"])
    best = {k: (min(v) if v else None) for k, v in times.items()}
    assert doc is not None
    out: dict[str, Any] = {
        "bench": "analyze",
        "machine": machine_info(),
        "trace": os.path.basename(args.trace),
        "requests": trace.num_requests,
        "block_refs": trace.num_block_refs,
        "capacity_blocks": args.capacity_blocks,
        "repeat": args.repeat,
        "kvtier_read_s": read_s,
        "seconds": best,
        "kvtier_hit_blocks": doc["hit_blocks"],
        "kvtier_token_hit_ratio": doc["token_hit_ratio"],
        "curve_points": len(all_caps),
        "curve_hit_blocks_at_capacity": int(curve.hit_blocks[args.capacity_blocks]),
        "lmcache": None if events is None else "lmcache.tools.cache_simulator.simulator.simulate",
    }
    if events is None:
        out["lmcache_note"] = (
            "lmcache not importable: pip install --no-deps lmcache sortedcontainers"
        )
        summary = (
            f"analyze {out['trace']}: kvtier report {best['kvtier_report']:.3f} s, "
            f"curve of {len(all_caps):,} capacities {best['kvtier_curve']:.3f} s "
            "(lmcache not importable; no peer timing)"
        )
    else:
        assert lm_full is not None
        out["lmcache_hit_blocks"] = int(sum(lm_full["hit_prefix_lengths"]))
        out["hits_agree"] = out["lmcache_hit_blocks"] == doc["hit_blocks"]
        out["ratio_report_vs_lmcache_full"] = best["kvtier_report"] / best["lmcache_full"]
        out["ratio_curve_vs_lmcache_fast"] = best["kvtier_curve"] / best["lmcache_fast"]
        summary = (
            f"analyze {out['trace']}: kvtier report {best['kvtier_report']:.3f} s vs "
            f"lmcache full {best['lmcache_full']:.3f} s (x{out['ratio_report_vs_lmcache_full']:.2f}); "
            f"kvtier curve of {len(all_caps):,} capacities {best['kvtier_curve']:.3f} s vs "
            f"lmcache fast, one capacity, {best['lmcache_fast']:.3f} s "
            f"(x{out['ratio_curve_vs_lmcache_fast']:.2f}); hits agree: {out['hits_agree']}"
        )
    print(json.dumps(out, indent=2))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
