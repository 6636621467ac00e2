"""Engine-side TTFT breakdown from a ``--request-log`` file (engine/request_log.py), split into
requests that reused most of their prompt (a later chat round: at least ``--reused`` of the
prompt's tokens came from a cache tier, the GPU included) and fresh ones.

Usage: python -m bench.ttft_breakdown LOG [--reused 0.5] [--skip 0] [--out FILE]

Per group: how many, engine TTFT p50/p90, each phase's p50 (ms), and how far the phases'
sum strays from the TTFT (they should add up: engine/ttft.py). ``--skip N`` drops the first N
entries (a warm-up request). Over every entry, ``cost_options``: per strategy that ``decision:
cost`` weighed (the request log's ``kv_plan.options``), how often it was chosen and weighed,
and the p50 of its raw price and of the ratio that ranked it. Prints JSON, then a one-line
summary.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.common import emit_report, machine_info, percentile
from engine.ttft import ENGINE_PHASES, STEP_CPU_PARTS, STEP_PARTS, STEP_SUB_PARTS, SUB_PHASES

BLOCK_TOKENS = 16
# Phases that add up to the engine TTFT (the parts of ``schedule`` and ``load`` aside).
_ADDING = [p for p in ENGINE_PHASES if p not in SUB_PHASES]


def _p(values: list[float], q: float) -> float | None:
    return round(percentile(sorted(values), q) * 1e3, 3) if values else None


def group_report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in rows]
    phases = {p: _p([r["ttft_breakdown_s"].get(p, 0.0) for r in rows], 50) for p in ENGINE_PHASES}
    gaps = [
        abs(sum(r["ttft_breakdown_s"].get(p, 0.0) for p in _ADDING) - r["ttft_s"])
        / max(r["ttft_s"], 1e-9)
        for r in rows
    ]
    return {
        "requests": len(rows),
        "ttft_ms": {"p50": _p(ttft, 50), "p90": _p(ttft, 90)},
        "phases_p50_ms": phases,
        "phase_sum_error_max": round(max(gaps), 4) if gaps else None,
        "prompt_tokens_p50": percentile(sorted(r["prompt_tokens"] for r in rows), 50)
        if rows
        else None,
        "cached_tokens_p50": percentile(
            sorted(len(r["hit_tiers"]) * BLOCK_TOKENS for r in rows), 50
        )
        if rows
        else None,
        # What the steps computing its prompt carried (others' chunks and decodes included).
        "prefill_step_tokens_p50": percentile(
            sorted(r.get("prefill_step_tokens", 0) for r in rows), 50
        )
        if rows
        else None,
        "plan_p50_tokens": {
            k: percentile(sorted((r.get("kv_plan") or {}).get(k, 0) for r in rows), 50)
            if rows
            else None
            for k in ("gpu_tokens", "head_tokens", "load_tokens", "recompute_tokens")
        },
        "decisions": {
            d: sum(r.get("decision") == d for r in rows)
            for d in sorted({r.get("decision", "") for r in rows})
        },
        # Where its prefill steps' time went in the model runner (engine/ttft.py STEP_PARTS).
        "step_parts_p50_ms": {
            k: _p([(r.get("prefill_step_parts_s") or {}).get(k, 0.0) for r in rows], 50)
            for k in (*STEP_PARTS, *STEP_CPU_PARTS, *STEP_SUB_PARTS)
        }
        if any(r.get("prefill_step_parts_s") for r in rows)
        else None,
    }


def cost_options(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Over every entry whose ``kv_plan`` has ``options`` (what ``decision: cost`` weighed):
    per strategy, how often it was chosen, how often weighed, and the p50 of its raw price
    (ms) and of the ratio that ranked it. Shows whether a price or a ratio decided a run."""
    weighed: dict[str, list[tuple[float, float]]] = {}
    chosen: dict[str, int] = {}
    for r in lines:
        options = (r.get("kv_plan") or {}).get("options") or {}
        for i, (kind, (price, ratio)) in enumerate(options.items()):
            weighed.setdefault(kind, []).append((price, ratio))
            if i == 0:
                chosen[kind] = chosen.get(kind, 0) + 1
    return {
        kind: {
            "chosen": chosen.get(kind, 0),
            "weighed": len(v),
            "price_p50_ms": _p([price for price, _ in v], 50),
            "ratio_p50": round(percentile(sorted(ratio for _, ratio in v), 50), 3),
        }
        for kind, v in sorted(weighed.items())
    }


def _options_line(options: dict[str, dict[str, Any]]) -> str:
    if not options:
        return ""
    return "; cost options (chosen/weighed, p50 price x ratio): " + ", ".join(
        f"{k} {o['chosen']}/{o['weighed']} {o['price_p50_ms']:.1f} ms x{o['ratio_p50']:.2f}"
        for k, o in options.items()
    )


def is_reused(row: dict[str, Any], reused: float) -> bool:
    """A request-log entry at least ``reused`` of whose prompt came from a cache tier (the GPU
    included)."""
    return len(row["hit_tiers"]) * BLOCK_TOKENS >= reused * max(row["prompt_tokens"], 1)


def breakdown(lines: list[dict[str, Any]], reused: float) -> dict[str, Any]:
    rows = [r for r in lines if r.get("ttft_s") is not None and r.get("ttft_breakdown_s")]
    hit = [r for r in rows if is_reused(r, reused)]
    fresh = [r for r in rows if r not in hit]
    return {"reused": group_report(hit), "fresh": group_report(fresh)}


def _line(name: str, g: dict[str, Any]) -> str:
    if not g["requests"]:
        return f"{name}: none"
    ph = g["phases_p50_ms"]
    top = sorted(((v or 0.0, k) for k, v in ph.items() if k not in SUB_PHASES), reverse=True)
    parts = ", ".join(f"{k} {v:.1f}" for v, k in top[:4])
    return (
        f"{name}: {g['requests']} req, TTFT p50 {g['ttft_ms']['p50']:.1f} ms "
        f"(p90 {g['ttft_ms']['p90']:.1f}); p50 phases {parts} ms; "
        f"phase sum within {100 * (g['phase_sum_error_max'] or 0):.1f}%; "
        f"its prefill steps carried {g['prefill_step_tokens_p50']} tokens (p50)"
        + (
            "; in the runner " + ", ".join(f"{k} {v:.1f}" for k, v in sp.items()) + " ms"
            if (sp := g.get("step_parts_p50_ms"))
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--reused", type=float, default=0.5)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(args.log, encoding="utf-8") as f:
        lines = [json.loads(x) for x in f if x.strip()][args.skip :]
    groups = breakdown(lines, args.reused)
    options = cost_options(lines)
    report = {
        "machine": machine_info(),
        "params": vars(args),
        **groups,
        "cost_options": options,
        "summary": "ttft_breakdown: "
        + "; ".join(_line(k, v) for k, v in groups.items())
        + _options_line(options),
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
