"""bench/write_policy.py on CPU at its smallest: both variants run the same workload through real
LMDB, and the report's counters say what each policy did (write-through copied every saved block
before close, write-back nothing, the host tier never filling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.write_policy import main


def test_write_policy_bench_reports_both_variants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "--requests",
                "4",
                "--concurrency",
                "2",
                "--max-tokens",
                "4",
                "--reps",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"write_back", "write_through"}
    # The same workload takes the same steps, give or take the empty steps a prefetch still
    # running adds (each waits at most 5 ms for it, so their number depends on the machine's
    # load); a connector that spins while a job runs adds hundreds.
    steps = runs["write_back"]["steps"], runs["write_through"]["steps"]
    assert min(steps) > 0 and abs(steps[0] - steps[1]) <= 2, steps
    assert runs["write_through"]["lmdb_written_through"] > 0
    assert (
        runs["write_back"]["lmdb_written_through"] == runs["write_back"]["lmdb_written_back"] == 0
    )
    assert runs["write_through"]["write_queue_dropped"] == 0
    figures = report["figures"]
    assert figures["write_through"]["step_ms_median"] > 0
    assert "forward_overhead_pct" in figures and report["machine"]["cpu_count"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == report["summary"]
