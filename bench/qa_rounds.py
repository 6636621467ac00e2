"""Client-side TTFT by round from the vLLM production-stack multi-round QA client's CSV
(``--output``: one row per request, ``question_id`` its round, ``ttft`` in seconds).

Usage: python -m bench.qa_rounds NAME=CSV [NAME=CSV ...] [--request-log NAME=LOG ...] [--out FILE]

Per run: requests, TTFT p50/p90 of the first round (a fresh history) and of later rounds (the
history a cache can serve), and where more than one run is given, each later run's later-round
p50 and p90 against the first run's (``speedup``: first / this, so above 1 is faster). With a
run's engine request log (``kvtier serve --request-log``), each later-round row is matched to
its engine entry (same prompt tokens, the nearest arrival at or after the client's launch) and
``client_minus_engine_ms`` gives the client's TTFT less the engine's, p50/p90: the time the
client sees outside the engine (HTTP, template and tokenizer, the first chunk's way back, the
client itself), which a TTFT ratio pays on both sides. ``by_burst`` splits the matched rows by
whether a first-round request (a new user's whole history to prefill) was sent within
``BURST_S`` of them: the client sends its users' turns in bursts, and a turn whose first token
decodes to no text waits for the next step, which in such a burst carries that prompt's long
chunk. Where the API's return log lies beside the request log (``engine.server.return_log``),
each group also gets the p50 of the time before the engine's arrival stamp (the client's
send, HTTP), of ``return`` and of ``first_text``. ``history_missed`` counts the matched later rounds that found under half of their
blocks anywhere (the GPU or a tier: the request log's ``hit_tiers`` and ``kv_plan``), with when they were sent
(seconds after the run's first request): a history recomputed although it was saved a round
before. Prints JSON, then a one-line summary.
"""

from __future__ import annotations

import argparse
import csv
import json
from typing import Any

from bench.common import emit_report, machine_info, percentile
from engine.server.return_log import return_log_path

BURST_S = 0.05  # a later-round turn and a first round sent this close together: one burst


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


def _found_under_half(entry: dict[str, Any]) -> bool:
    """Whether a request log entry found under half its blocks cached: on the GPU, or in a tier
    (loaded, or an overlap's head: its ``kv_plan``, which ``hit_tiers`` does not cover)."""
    blocks, hits = entry.get("block_hashes"), entry.get("hit_tiers")
    if not blocks or hits is None:
        return False
    plan = entry.get("kv_plan") or {}
    cached = sum(plan.get(k, 0) for k in ("gpu_tokens", "head_tokens", "load_tokens")) // 16
    return 2 * max(len(hits), cached) < len(blocks)


def _api_times(log_path: str) -> dict[str, dict[str, float]]:
    """The API's return log beside the request log (``engine.server.return_log``), by
    engine request id; empty when there is none (a run before it existed)."""
    path = return_log_path(log_path)
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return {line["req_id"]: line for line in lines}


def match_engine(csv_path: str, log_path: str, slack_s: float = 0.05) -> dict[str, Any]:
    """Later-round client rows of ``csv_path`` against their entries in the request log."""
    with open(csv_path, encoding="utf-8", newline="") as f:
        every = list(csv.DictReader(f))
    rows = [r for r in every if int(float(r["question_id"])) > 1]
    firsts = [float(r["launch_time"]) for r in every if int(float(r["question_id"])) == 1]
    with open(log_path, encoding="utf-8") as f:
        entries = [json.loads(line) for line in f if line.strip()]
    free = [e for e in entries if e.get("ttft_s") is not None]
    split: dict[str, dict[str, list[float]]] = {
        g: {"client": [], "engine": [], "gap": [], "pre": [], "return": [], "first_text": []}
        for g in ("with_first_round", "alone")
    }
    api = _api_times(log_path)
    start = min((float(r["launch_time"]) for r in every), default=0.0)
    missed: list[float] = []  # when later rounds that found under half their blocks were sent
    for r in sorted(rows, key=lambda r: float(r["launch_time"])):
        launch, tokens = float(r["launch_time"]), int(float(r["prompt_tokens"]))
        cands = [e for e in free if e["prompt_tokens"] == tokens and e["ts"] >= launch - slack_s]
        if not cands:
            continue
        e = min(cands, key=lambda e: e["ts"])
        free.remove(e)
        if _found_under_half(e):
            missed.append(round(launch - start, 1))
        burst = any(abs(t - launch) <= BURST_S for t in firsts)
        group = split["with_first_round" if burst else "alone"]
        group["client"].append(float(r["ttft"]))
        group["engine"].append(e["ttft_s"])
        group["gap"].append(float(r["ttft"]) - e["ttft_s"])
        times = api.get(e.get("req_id", ""))
        if times is not None:  # the client's TTFT split: before arrival, engine, return, text
            group["pre"].append(e["ts"] - launch)
            group["return"].append(times["return_s"])
            group["first_text"].append(times["first_text_s"])
    gaps = [g for v in split.values() for g in v["gap"]]
    engine = [t for v in split.values() for t in v["engine"]]
    return {
        "matched": len(gaps),
        "later_rounds": len(rows),
        "engine_ttft_ms": {"p50": _ms(engine, 50), "p90": _ms(engine, 90)},
        "client_minus_engine_ms": {"p50": _ms(gaps, 50), "p90": _ms(gaps, 90)},
        "history_missed": {"n": len(missed), "sent_at_s": missed},
        "by_burst": {
            g: {
                "n": len(v["client"]),
                "client_p50_ms": _ms(v["client"], 50),
                "engine_p50_ms": _ms(v["engine"], 50),
                "client_minus_engine_p50_ms": _ms(v["gap"], 50),
                # with the API's return log (``kvtier serve --request-log``): client send ->
                # the engine's arrival stamp, the first token's way back, the wait for text
                "before_arrival_p50_ms": _ms(v["pre"], 50),
                "return_p50_ms": _ms(v["return"], 50),
                "first_text_p50_ms": _ms(v["first_text"], 50),
            }
            for g, v in split.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=CSV, the baseline first")
    ap.add_argument("--request-log", action="append", default=[], metavar="NAME=LOG")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    args_csv: dict[str, str] = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"expected NAME=CSV, got {spec!r}")
        args_csv[name] = path
        try:
            runs[name] = read_rounds(path)
        except (OSError, KeyError, ValueError) as exc:
            runs[name] = {"error": f"{path}: {exc}"}
    for spec in args.request_log:
        name, sep, path = spec.partition("=")
        if not sep or name not in runs or "error" in runs[name]:
            continue
        try:
            runs[name]["engine"] = match_engine(args_csv[name], path)
        except (OSError, KeyError, ValueError) as exc:
            runs[name]["engine"] = {"error": f"{path}: {exc}"}
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
        eng = r.get("engine", {})
        if eng.get("matched"):
            s += (
                f" [engine p50 {eng['engine_ttft_ms']['p50']} ms, client - engine p50 "
                f"{eng['client_minus_engine_ms']['p50']} ms"
            )
            w, a = eng["by_burst"]["with_first_round"], eng["by_burst"]["alone"]
            if w["n"]:
                s += (
                    f"; sent with a first round: n={w['n']} client p50 {w['client_p50_ms']} / "
                    f"engine {w['engine_p50_ms']} ms, alone: n={a['n']} client p50 "
                    f"{a['client_p50_ms']} / engine {a['engine_p50_ms']} ms"
                )
            for g, label in ((w, "with a first round"), (a, "alone")):
                if g["n"] and g["return_p50_ms"] is not None:
                    s += (
                        f"; {label}: before arrival {g['before_arrival_p50_ms']}, return "
                        f"{g['return_p50_ms']}, first text {g['first_text_p50_ms']} ms p50"
                    )
            missed = eng["history_missed"]["sent_at_s"]
            if missed:
                s += (
                    f"; {len(missed)} later rounds found under half their blocks (sent at "
                    f"{missed[0]}-{missed[-1]} s)"
                )
            s += "]"
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
