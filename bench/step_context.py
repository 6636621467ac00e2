"""What the steps around a request's first token carried: a request log (``--request-log``)
read against the engine's step log (``--step-log``, engine/step_log.py).

Usage: python -m bench.step_context REQUESTS STEPS [--reused 0.5] [--out FILE]

For each request that reused most of its prompt (as ``bench.ttft_breakdown``: at least
``--reused`` of its tokens came from a cache tier) and got a first token, the step that sampled
it (``own``: its time, ``forward``, tokens, decodes, the other requests' prompt tokens in it,
whether a load finished in it) and the time from its arrival to that step's start
(``before_own_ms``) with the longest step that started meanwhile (``longest_before_ms``): a
reused request slow because its own step was heavy reads differently from one that waited
behind another request's chunk. ``by_loads``: the requests whose own step finished loads, by
how many loads it finished (1: loaded alone; 2: a pair), with the p50 of their TTFT, own step,
its forward, the engine thread's CPU in that forward and its ``sample``: a forward whose CPU
equals its wall time followed by a ``sample`` near zero was held in its launches until the
GPU caught up (docs/scheduling.md, twenty-seventh session). Prints JSON (per request and
p50 / p90 of each) and a one-line summary.
"""

from __future__ import annotations

import argparse
import bisect
import json
from typing import Any

from bench.common import emit_report, machine_info, percentile
from bench.ttft_breakdown import is_reused

FIELDS = (
    "ttft_ms",
    "before_own_ms",
    "longest_before_ms",
    "own_ms",
    "own_forward_ms",
    "own_tokens",
    "own_other_prefill_tokens",
    "own_decodes",
)
# the p50s ``by_loads`` gives per number of loads a step finished
BY_LOADS = ("ttft_ms", "own_ms", "own_forward_ms", "own_forward_cpu_ms", "own_sample_ms")


def _read(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def request_context(
    request: dict[str, Any], steps: list[dict[str, Any]], starts: list[float]
) -> dict[str, Any] | None:
    """The context of one request's first token, or None when no step after its arrival
    sampled its prompt's last chunk (``steps`` sorted by start, ``starts`` their starts)."""
    req_id = request["req_id"]
    arrival = request["ts"]
    first = bisect.bisect_left(starts, arrival)
    at = next(
        (
            i
            for i in range(first, len(steps))
            if any(c[0] == req_id and c[3] for c in steps[i]["prefill"])
        ),
        None,
    )
    if at is None:
        return None
    own, before = steps[at], steps[first:at]
    other = sum(c[1] for c in own["prefill"] if c[0] != req_id)
    return {
        "req_id": req_id,
        "ttft_ms": round(request["ttft_s"] * 1e3, 3),
        "before_own_ms": round((own["t"] - arrival) * 1e3, 3),
        "steps_before": len(before),
        "longest_before_ms": max((s["ms"] for s in before), default=0.0),
        "own_ms": own["ms"],
        "own_forward_ms": own["parts"].get("forward", 0.0),
        "own_forward_cpu_ms": own["parts"].get("forward_cpu", 0.0),
        "own_sample_ms": own["parts"].get("sample", 0.0),
        "own_loads": len(own["loads"]),
        "own_tokens": own["tokens"],
        "own_other_prefill_tokens": other,
        "own_decodes": own["decodes"],
        "own_has_load": any(load[0] == req_id for load in own["loads"]),
    }


def step_context(
    requests: list[dict[str, Any]], steps: list[dict[str, Any]], reused: float
) -> dict[str, Any]:
    steps = sorted(steps, key=lambda s: s["t"])
    starts = [s["t"] for s in steps]
    rows = []
    for r in requests:
        if r.get("ttft_s") is None or not is_reused(r, reused):
            continue
        row = request_context(r, steps, starts)
        if row is not None:
            rows.append(row)
    stats = {
        f: {q: round(percentile(sorted(float(x[f]) for x in rows), q), 3) for q in (50, 90)}
        for f in FIELDS
    }
    by_loads: dict[str, dict[str, Any]] = {}
    for n in sorted({x["own_loads"] for x in rows if x["own_has_load"]}):
        group = [x for x in rows if x["own_has_load"] and x["own_loads"] == n]
        by_loads[str(n)] = {"n": len(group)} | {
            f: round(percentile(sorted(float(x[f]) for x in group), 50), 3) for f in BY_LOADS
        }
    return {"requests": rows, "stats": stats if rows else {}, "by_loads": by_loads}


def summary(result: dict[str, Any]) -> str:
    stats = result["stats"]
    if not stats:
        return "step_context: no reused request with a first token"
    p = {f: stats[f][50] for f in FIELDS}
    return (
        f"step_context: {len(result['requests'])} reused requests, p50: TTFT {p['ttft_ms']:.1f} ms, "
        f"arrival to own step {p['before_own_ms']:.1f} ms (longest step meanwhile "
        f"{p['longest_before_ms']:.1f}), own step {p['own_ms']:.1f} ms (forward "
        f"{p['own_forward_ms']:.1f}; {p['own_tokens']:.0f} tokens, of them "
        f"{p['own_other_prefill_tokens']:.0f} other prompts', {p['own_decodes']:.0f} decodes)"
        + "".join(
            f"; {n} load(s) a step: {g['n']} req, TTFT {g['ttft_ms']:.1f}, step {g['own_ms']:.1f}, "
            f"forward {g['own_forward_ms']:.1f} (cpu {g['own_forward_cpu_ms']:.1f}), sample "
            f"{g['own_sample_ms']:.1f} ms"
            for n, g in result.get("by_loads", {}).items()
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("requests")
    ap.add_argument("steps")
    ap.add_argument("--reused", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = step_context(_read(args.requests), _read(args.steps), args.reused)
    report = {"machine": machine_info(), "params": vars(args), **result}
    report["summary"] = summary(result)
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
