"""bench/ttft_breakdown.py: the cost decisions' options summed up over a request log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ttft_breakdown import main


def entry(options: dict[str, list[float]] | None, ttft_s: float = 0.2) -> dict[str, object]:
    plan = None if options is None else {"load_tokens": 0, "options": options}
    return {
        "prompt_tokens": 320,
        "hit_tiers": ["gpu"] * 4,
        "ttft_s": ttft_s,
        "ttft_breakdown_s": {"prefill_compute": ttft_s},
        "kv_plan": plan,
    }


def test_cost_options_show_what_each_decision_weighed(tmp_path: Path) -> None:
    """Three priced decisions (two recomputes over a load at 3x, one load) and two entries
    that priced nothing: the load was the cheaper price every time, its ratio what lost it."""
    lines = [
        entry({"recompute": [0.085, 1.0], "load_prefix": [0.0587, 3.0]}),
        entry({"recompute": [0.086, 1.0], "load_prefix": [0.060, 2.6]}),
        entry({"load_prefix": [0.058, 1.0], "recompute": [0.084, 1.0]}),
        entry({}),
        entry(None),
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    out = tmp_path / "r.json"
    assert main([str(log), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    options = report["cost_options"]
    assert options["recompute"]["chosen"] == 2 and options["recompute"]["weighed"] == 3
    assert options["load_prefix"]["chosen"] == 1 and options["load_prefix"]["weighed"] == 3
    assert options["recompute"]["price_p50_ms"] == pytest.approx(85.0)
    assert options["load_prefix"]["price_p50_ms"] == pytest.approx(58.7)
    assert options["load_prefix"]["ratio_p50"] == pytest.approx(2.6)
    assert "load_prefix 1/3 58.7 ms x2.60" in report["summary"]
    assert "recompute 2/3 85.0 ms x1.00" in report["summary"]
