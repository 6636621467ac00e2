"""bench/cpu_attention.py on a small point: every path timed, the kernel's output equal to SDPA's,
and the JSON's summary names each point."""

from __future__ import annotations

import json

import pytest

from bench import cpu_attention
from engine.kernels import cpu_prefill

pytestmark = pytest.mark.skipif(not cpu_prefill.enabled(), reason="no C compiler here")


def test_a_point_times_every_path_and_the_kernel_matches_sdpa() -> None:
    row = cpu_attention.measure("smollm2", 130, threads=1, reps=2)
    assert row["kernel_ms"] > 0 and row["sdpa_ms"] > 0 and row["gemm_ms"] > 0
    assert row["max_abs_diff_vs_sdpa"] < 1e-4
    fastest_torch = min(row["sdpa_ms"], row["gemm_ms"])
    assert row["kernel_vs_best_torch"] == pytest.approx(row["kernel_ms"] / fastest_torch, rel=0.01)


def test_the_report_is_json_with_a_summary_line(tmp_path, capsys) -> None:
    out = tmp_path / "attn.json"
    argv = "--lengths 70 --threads 1 --shapes llama3 --reps 1 --out".split() + [str(out)]
    assert cpu_attention.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["vector_floats"] == cpu_prefill.vector_floats()
    assert [r["length"] for r in report["rows"]] == [70]
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == report["summary"]
    assert "llama3 T=70 x1" in report["summary"]
