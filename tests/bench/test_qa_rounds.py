"""bench/qa_rounds.py splits the QA client's CSV into round 1 and later rounds and compares later
runs with the first."""

from __future__ import annotations

import json
from pathlib import Path

from bench.qa_rounds import main

HEADER = "prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,launch_time,finish_time\n"


def write(path: Path, ttfts: list[tuple[int, float]]) -> str:
    path.write_text(HEADER + "".join(f"3000,100,{t},1.0,0,{q},0,1\n" for q, t in ttfts))
    return str(path)


def test_later_rounds_are_compared_with_the_first_run(tmp_path: Path) -> None:
    off = write(tmp_path / "off.csv", [(1, 0.3), (2, 0.2), (3, 0.2), (4, 0.2)])
    on = write(tmp_path / "on.csv", [(1, 0.3), (2, 0.05), (3, 0.05), (4, 0.05)])
    out = tmp_path / "r.json"
    assert (
        main([f"off={off}", f"on={on}", f"gone={tmp_path / 'missing.csv'}", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert report["runs"]["off"]["first_round"]["n"] == 1
    assert report["runs"]["on"]["later_rounds"] == {"n": 3, "p50_ms": 50.0, "p90_ms": 50.0}
    assert report["later_round_speedup"]["on"]["p50_ms"] == 4.0
    assert report["later_round_speedup"]["gone"]["p50_ms"] is None
    assert "missing.csv" in report["runs"]["gone"]["error"]
