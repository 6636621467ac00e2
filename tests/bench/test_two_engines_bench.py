"""bench/two_engines.py at its smallest, on a tiny random model: two ``kvtier serve`` engine
processes on the default offload config; the second, running since before the first computed
the chat, loads it from the LMDB directory they share and answers the same."""

from __future__ import annotations

import json
from pathlib import Path

from bench.two_engines import main
from tests.engine.hf_models import make_tiny_model


def test_the_second_engine_loads_what_the_first_computed(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=3)
    out = tmp_path / "report.json"
    main(["--model", model, "--words", "60", "--out", str(out)])
    report = json.loads(out.read_text())
    a, b = report["a"], report["b"]
    assert a["decision"] == "recompute" and a["tier_blocks"] == 0
    assert b["decision"] == "load_prefix" and b["tier_blocks"] == a["prompt_tokens"] // 16
    assert report["same_answer"] and report["exit_codes"] == [0, 0]
