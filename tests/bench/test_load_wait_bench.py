"""bench/load_wait.py at its smallest, on a tiny random model: a history stored in LMDB comes
back beside a long prompt, once with steps capped while its load runs and once without."""

from __future__ import annotations

import json
from pathlib import Path

from bench.load_wait import main
from tests.engine.hf_models import make_tiny_model


def test_the_capped_engine_defers_prefill_while_the_reload_runs(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=3)
    out = tmp_path / "report.json"
    args = ["--model", model, "--trials", "2", "--prefix", "64", "--long", "400"]
    main([*args, "--budget", "128", "--cap", "16", "--out", str(out)])
    report = json.loads(out.read_text())
    for mode in ("off", "cap"):
        for t in report["modes"][mode]["trials"]:
            assert t["reused_lmdb_tokens"] == 64  # the whole history, from LMDB
            assert t["reused_phases_s"]["load"] > 0  # asynchronously
    # only the capped engine cut steps (the long prompt's chunks while a reload ran)
    assert report["load_wait_deferred_tokens"]["off"] == 0
    assert report["load_wait_deferred_tokens"]["cap"] > 0
    assert report["reused_ttft_ratio"] > 0 and report["summary"].startswith("load_wait (")
