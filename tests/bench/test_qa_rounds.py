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


def run_with_log(
    tmp_path: Path,
    rows: list[tuple[int, float, int, float]],
    entries: list[tuple[float, int, float]],
) -> Path:
    """``main`` over one run ``on``: its CSV from ``rows`` (prompt_tokens, ttft, question_id,
    launch_time) and its request log from ``entries`` (ts, prompt_tokens, ttft_s); the report's
    path."""
    csv_path = tmp_path / "on.csv"
    csv_path.write_text(
        HEADER + "".join(f"{p},100,{t},1.0,0,{q},{at},{at + 1}\n" for p, t, q, at in rows)
    )
    log = tmp_path / "on.jsonl"
    log.write_text(
        "".join(
            json.dumps({"ts": ts, "prompt_tokens": p, "ttft_s": t}) + "\n" for ts, p, t in entries
        )
    )
    out = tmp_path / "r.json"
    assert main([f"on={csv_path}", "--request-log", f"on={log}", "--out", str(out)]) == 0
    return out


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


def test_later_rounds_are_matched_to_the_engines_request_log(tmp_path: Path) -> None:
    """Each later-round row meets the engine entry with its prompt length that arrived first at
    or after its launch (two users with equal prompt lengths, launched 1 s apart, each take
    their own); the client's TTFT less the engine's is reported, round 1 left out."""
    rows = [  # prompt_tokens, ttft, question_id, launch_time
        (6000, 0.300, 1, 10.0),
        (6300, 0.080, 2, 20.0),
        (6300, 0.100, 2, 21.0),
        (6500, 0.090, 3, 30.0),
    ]
    entries = [  # ts (arrival, after the API's tokenizing), prompt_tokens, ttft_s
        (10.01, 6000, 0.29),
        (21.01, 6300, 0.06),  # the second user's, logged first
        (20.01, 6300, 0.05),
        (30.02, 6500, 0.07),
        (40.0, 7000, 0.05),  # nobody's later round
    ]
    out = run_with_log(tmp_path, rows, entries)
    engine = json.loads(out.read_text())["runs"]["on"]["engine"]
    assert engine["matched"] == 3 and engine["later_rounds"] == 3
    # gaps 30, 40 and 20 ms; engine TTFTs 50, 60, 70 ms
    assert engine["client_minus_engine_ms"]["p50"] == 30.0
    assert engine["engine_ttft_ms"]["p50"] == 60.0
    # no first round was sent near any of them
    assert engine["by_burst"]["with_first_round"]["n"] == 0
    assert engine["by_burst"]["alone"]["n"] == 3


def test_later_rounds_sent_with_a_first_round_are_reported_apart(tmp_path: Path) -> None:
    """Two bursts: a pair of later rounds alone, and a pair with a new user's first round sent
    3 ms after it; each group gets its client and engine p50 and the gap."""
    rows = [  # prompt_tokens, ttft, question_id, launch_time
        (6300, 0.060, 2, 10.000),
        (6310, 0.062, 2, 10.002),
        (6320, 0.130, 3, 12.000),
        (6330, 0.134, 3, 12.002),
        (6086, 0.190, 1, 12.005),
    ]
    entries = [(10.01, 6300, 0.048), (10.01, 6310, 0.050), (12.01, 6320, 0.064)]
    entries += [(12.01, 6330, 0.066), (12.02, 6086, 0.17)]
    out = run_with_log(tmp_path, rows, entries)
    report = json.loads(out.read_text())
    burst = report["runs"]["on"]["engine"]["by_burst"]
    assert burst["alone"] == {
        "n": 2,
        "client_p50_ms": 60.0,
        "engine_p50_ms": 48.0,
        "client_minus_engine_p50_ms": 12.0,
        # no API return log beside this request log
        "before_arrival_p50_ms": None,
        "return_p50_ms": None,
        "first_text_p50_ms": None,
    }
    assert burst["with_first_round"]["n"] == 2
    assert burst["with_first_round"]["engine_p50_ms"] == 64.0
    assert burst["with_first_round"]["client_minus_engine_p50_ms"] == 66.0
    assert "sent with a first round: n=2" in report["summary"]


def test_later_rounds_that_found_their_history_nowhere_are_counted(tmp_path: Path) -> None:
    """A later round whose engine entry hit under half its blocks (GPU or tiers) recomputed a
    history saved a round before: counted, with when it was sent after the run's start."""
    csv_path = tmp_path / "on.csv"
    csv_path.write_text(
        HEADER
        + "6000,100,0.3,1.0,0,1,10.0,11.0\n"
        + "6300,100,0.2,1.0,0,2,22.0,23.0\n"
        + "6400,100,0.06,1.0,0,3,32.0,33.0\n"
    )
    entry = lambda ts, p, t, hits: {  # noqa: E731
        "ts": ts,
        "prompt_tokens": p,
        "ttft_s": t,
        "block_hashes": ["h"] * (p // 16),
        "hit_tiers": hits,
    }
    log = tmp_path / "on.jsonl"
    log.write_text(
        "".join(
            json.dumps(e) + "\n"
            for e in (
                entry(10.01, 6000, 0.29, []),
                entry(22.01, 6300, 0.19, ["gpu"] * 126),  # only the shared prompt: missed
                entry(32.01, 6400, 0.05, ["gpu"] * 126 + ["host"] * 270),
            )
        )
    )
    out = tmp_path / "r.json"
    assert main([f"on={csv_path}", "--request-log", f"on={log}", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["runs"]["on"]["engine"]["history_missed"] == {"n": 1, "sent_at_s": [12.0]}
    assert "1 later rounds found under half their blocks (sent at 12.0-12.0 s)" in report["summary"]


def test_the_apis_return_log_splits_what_the_client_saw_past_the_engine(tmp_path: Path) -> None:
    """With the API's return log beside the request log (``run.api.jsonl`` by ``run.jsonl``),
    each matched later round's client TTFT splits into the time before the engine's arrival
    stamp, the engine's TTFT, the first token's return and the wait for text."""
    csv_path = tmp_path / "on.csv"
    rows = [(6300, 0.080, 2, 20.0), (6400, 0.100, 2, 30.0), (6500, 0.090, 3, 40.0)]
    csv_path.write_text(
        HEADER + "".join(f"{p},100,{t},1.0,0,{q},{at},{at + 1}\n" for p, t, q, at in rows)
    )
    log = tmp_path / "run.jsonl"  # (req_id, ts, prompt_tokens, ttft_s)
    entries = [
        ("a-0", 20.008, 6300, 0.05),
        ("b-0", 30.010, 6400, 0.06),
        ("c-0", 40.012, 6500, 0.05),
    ]
    log.write_text(
        "".join(
            json.dumps({"req_id": r, "ts": ts, "prompt_tokens": p, "ttft_s": t}) + "\n"
            for r, ts, p, t in entries
        )
    )
    api = [("a-0", 0.004, 0.004), ("b-0", 0.005, 0.025), ("c-0", 0.006, 0.006), ("x-0", 1, 1)]
    (tmp_path / "run.api.jsonl").write_text(
        "".join(
            json.dumps({"req_id": r, "return_s": a, "first_text_s": b}) + "\n" for r, a, b in api
        )
    )
    out = tmp_path / "r.json"
    assert main([f"on={csv_path}", "--request-log", f"on={log}", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    alone = report["runs"]["on"]["engine"]["by_burst"]["alone"]
    assert alone["n"] == 3
    assert alone["before_arrival_p50_ms"] == 10.0
    assert alone["return_p50_ms"] == 5.0
    assert alone["first_text_p50_ms"] == 6.0
    assert "alone: before arrival 10.0, return 5.0, first text 6.0 ms p50" in report["summary"]
