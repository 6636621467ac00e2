"""bench/serving.py end to end on CPU: three ``kvtier serve`` processes (offload off, on, and
lossless) on a tiny bf16 random Llama, a short two-level qps sweep of streaming multi-round
chat users; the report has every figure, with the engine-side breakdown matched from each
server's request log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import serving, ttft_breakdown
from bench.random_model import write_model
from engine.ttft import API_PHASES, ENGINE_PHASES

pytestmark = pytest.mark.timeout(300)


def test_serving_bench_runs_every_mode_and_level(tmp_path: Path) -> None:
    model = write_model(str(tmp_path / "model"), "tiny", "cpu", None)
    out = tmp_path / "report.json"
    code = serving.main(
        [
            "--model",
            str(model),
            "--qps",
            "2,4",
            "--duration-s",
            "2",
            "--users",
            "2",
            "--rounds",
            "2",
            "--system-words",
            "40",
            "--history-words",
            "40",
            "--question-words",
            "5",
            "--answer-len",
            "4",
            "--pool-histories",
            "3",
            "--host-capacity",
            "16MiB",
            "--max-model-len",
            "1024",
            "--server-arg=--device=cpu",
            "--server-arg=--max-num-seqs=4",
            "--concurrent",
            "--log-dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert code == 0
    assert set(report["modes"]) == {"off", "offload", "lossless"}
    assert report["machine"]["cpu_count"] >= 1 and report["summary"].startswith("serving: ")
    assert report["params"]["num_gpu_blocks"] == 64  # 3 histories of ~215 tokens, at least 64
    for mode, res in report["modes"].items():
        assert res["server_exit"] == 0, mode
        assert [lv["qps"] for lv in res["levels"]] == [2.0, 4.0]
        for lv in res["levels"]:
            assert lv["requests"] >= 2 and lv["failed"] == 0, (mode, lv["errors"])
            assert lv["ttft_ms"]["p50"] > 0 and lv["itl_ms"]["p50"] > 0
            assert lv["output_tokens_per_s"] > 0
            assert lv["offered_qps"] == lv["qps"] and lv["processed_req_per_s"] > 0
            assert lv["completion_rate_req_per_s"] > 0 and lv["send_rate_req_per_s"] > 0
            server = lv["server"]  # /metrics deltas over the level
            assert server["steps"] > 0 and server["scheduler_ms_per_step"] > 0
            eng = lv["engine"]
            assert eng["matched"] == lv["requests"]  # every request found in its log
            assert set(eng["phases_ms"]) == {*API_PHASES, *ENGINE_PHASES}
            assert eng["phases_ms"]["prefill_compute"]["p50"] > 0
            assert eng["phases_ms"]["api_tokenize"]["p50"] > 0
            assert eng["hit_blocks_p50"] > 0  # the shared system prompt at least
        assert any(lv["ttft_later_rounds_ms"]["p50"] for lv in res["levels"]), mode
        assert res["quiet"]["batch"] == 2 and res["quiet"]["failed"] == 0
        assert res["quiet"]["itl_ms"]["p50"] > 0
    assert "x quiet" in report["summary"] and "req/s processed" in report["summary"]
    # The request log splits into reused (later rounds) and fresh requests.
    groups = ttft_breakdown.breakdown(
        [
            json.loads(x)
            for x in (tmp_path / "serving_offload.requests.jsonl").read_text().splitlines()
        ],
        0.5,
    )
    assert groups["reused"]["requests"] >= 1 and groups["fresh"]["requests"] >= 1
    assert groups["reused"]["cached_tokens_p50"] > 0


def test_bad_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, msg in (
        (["--modes", "fast"], "--modes: unknown"),
        (["--qps", "1,x"], "--qps"),
        (["--qps", "0"], "must be > 0"),
    ):
        with pytest.raises(SystemExit):
            serving.main(["--model", "x", *argv])
        assert msg in capsys.readouterr().err


def test_the_completion_rate_leaves_out_the_drain_but_not_falling_behind() -> None:
    from bench.serving import Record, steady_rates

    def recs(latencies: list[float]) -> list[Record]:
        out = []
        for i, lat in enumerate(latencies):  # one request a second
            r = Record(i, 1, float(i), ok=True)
            r.end_s = i + lat
            out.append(r)
        return out

    # Keeping up: 11 requests, each 3 s: sent and completed at 1/s, though 11 requests over a
    # 13 s wall clock read 0.85/s.
    assert steady_rates(recs([3.0] * 11)) == {
        "send_rate_req_per_s": 1.0,
        "completion_rate_req_per_s": 1.0,
    }
    # Falling behind: each request waits 0.5 s longer than the one before.
    assert steady_rates(recs([1.0 + 0.5 * i for i in range(11)]))[
        "completion_rate_req_per_s"
    ] == pytest.approx(10 / 15, abs=1e-3)
    failed = recs([1.0, 1.0, 1.0])
    failed[2].ok = False  # a failed request is not processed
    assert steady_rates(failed)["completion_rate_req_per_s"] == 1.0
    assert steady_rates(failed[:1]) == {
        "send_rate_req_per_s": None,
        "completion_rate_req_per_s": None,
    }
