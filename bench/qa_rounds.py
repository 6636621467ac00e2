"""Client-side TTFT by round from the vLLM production-stack multi-round QA client's CSV
(``--output``: one row per request, ``question_id`` its round, ``ttft`` in seconds).

Usage: python -m bench.qa_rounds NAME=CSV [NAME=CSV ...] [--out FILE]

Per run: requests, TTFT p50/p90 of the first round (a fresh history) and of later rounds (the
history a cache can serve), and where more than one run is given, each later run's later-round
p50 and p90 against the first run's (``speedup``: first / this, so above 1 is faster). Prints
JSON, then a one-line summary.
"""

from __future__ import annotations

import argparse
import csv
from typing import Any

from bench.common import emit_report, machine_info, percentile


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(sorted(values), q) * 1e3, 2) if values else None


def read_rounds(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    first = [float(r["ttft"]) for r in rows if int(float(r["question_id"])) == 1]
    later = [float(r["ttft"]) for r in rows if int(float(r["question_id"])) > 1]
    return {
        "requests": len(rows),
        "first_round": {"n": len(first), "p50_ms": _ms(first, 50), "p90_ms": _ms(first, 90)},
        "later_rounds": {"n": len(later), "p50_ms": _ms(later, 50), "p90_ms": _ms(later, 90)},
        "prompt_tokens_p50": percentile(sorted(float(r["prompt_tokens"]) for r in rows), 50)
        if rows
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=CSV, the baseline first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"expected NAME=CSV, got {spec!r}")
        try:
            runs[name] = read_rounds(path)
        except (OSError, KeyError, ValueError) as exc:
            runs[name] = {"error": f"{path}: {exc}"}
    names = list(runs)
    base = runs[names[0]].get("later_rounds", {})
    speedup: dict[str, dict[str, float | None]] = {}
    for name in names[1:]:
        later = runs[name].get("later_rounds", {})
        speedup[name] = {
            q: round(base[q] / later[q], 3) if base.get(q) and later.get(q) else None
            for q in ("p50_ms", "p90_ms")
        }

    def line(name: str) -> str:
        r = runs[name]
        if "error" in r:
            return f"{name}: {r['error']}"
        lr, fr = r["later_rounds"], r["first_round"]
        s = (
            f"{name}: later rounds p50 {lr['p50_ms']} ms p90 {lr['p90_ms']} ms (n={lr['n']}), "
            f"round 1 p50 {fr['p50_ms']} ms (n={fr['n']})"
        )
        if name in speedup:
            s += f", later p50 {speedup[name]['p50_ms']}x faster than {names[0]}"
        return s

    report = {
        "machine": machine_info(),
        "runs": runs,
        "later_round_speedup": speedup,
        "summary": "qa_rounds: " + "; ".join(line(n) for n in names),
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
