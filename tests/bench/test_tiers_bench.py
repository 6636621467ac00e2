"""bench/tiers.py at its smallest: every row carries the tier, its plain baseline from the same
run and their ratio, for put, get and get_into; the summary states the machine."""

from __future__ import annotations

import json

import pytest

from bench.tiers import main


def test_tiers_bench_reports_ratios_against_plain_baselines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            [
                "--tiers",
                "host,lmdb",
                "--sizes",
                "64KiB",
                "--total",
                "1MiB",
                "--batch",
                "8",
                "--repeats",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    report = json.loads(out[: out.rindex("summary")])
    assert report["machine"]["cpu_count"] > 0
    assert report["baselines"]["lmdb"] == "plain LMDB txn"
    rows = {(r["tier"], r["mode"], r["op"]): r for r in report["rows"]}
    for tier in ("host", "lmdb"):
        for mode in ("single", "batched"):
            for op in ("put", "get", "get_into"):
                row = rows[(tier, mode, op)]
                assert row["tier_gbps"] > 0 and row["base_gbps"] > 0 and row["ratio"] > 0
                assert len(row["tier_runs"]) == len(row["base_runs"]) == 3
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("summary (") and "CPUs" in summary and "median of 3" in summary
