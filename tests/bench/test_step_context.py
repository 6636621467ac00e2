"""bench/step_context.py on the logs of a real engine run (the tiny llama on CPU, offload on):
the request whose prompt came back from the host tier is found as reused, and its first-token
step is the step log's line that carried its chunk and its load."""

from __future__ import annotations

import json
from pathlib import Path

from bench.step_context import main, step_context
from engine import SamplingParams
from tests.connectors.offload.test_connector import make_llm
from tests.engine.hf_models import make_tiny_model


def test_the_reloaded_request_s_own_step_is_the_one_that_loaded_it(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=7)
    requests, steps = tmp_path / "requests.jsonl", tmp_path / "steps.jsonl"
    offload = {"decision": "load", "tiers": [{"kind": "host", "capacity": "8MiB"}]}
    llm = make_llm(model_dir, 24, offload, request_log=str(requests), step_log=str(steps))
    prompts = [[1, *range(10 + 90 * i, 109 + 90 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for prompt in (*prompts, prompts[0]):
        llm.generate([prompt], params)
    llm.close()
    lines = [json.loads(x) for x in requests.read_text().splitlines()]
    step_lines = [json.loads(x) for x in steps.read_text().splitlines()]
    result = step_context(lines, step_lines, reused=0.5)
    (row,) = result["requests"]  # only the resent prompt reused most of its tokens
    assert row["req_id"] == lines[-1]["req_id"] and row["own_has_load"]
    (own,) = [s for s in step_lines if any(ld[0] == row["req_id"] for ld in s["loads"])]
    assert row["own_ms"] == own["ms"] and row["own_tokens"] == own["tokens"] == 4
    assert row["own_other_prefill_tokens"] == 0 and row["own_decodes"] == 0
    assert 0 <= row["before_own_ms"] <= row["ttft_ms"]
    assert result["stats"]["own_tokens"] == {50: 4.0, 90: 4.0}
    assert row["own_loads"] == len(own["loads"]) == 1
    assert row["own_forward_cpu_ms"] == own["parts"]["forward_cpu"] > 0
    assert row["own_sample_ms"] == own["parts"]["sample"]
    by = result["by_loads"]
    assert list(by) == ["1"] and by["1"]["n"] == 1 and by["1"]["own_ms"] == own["ms"]
    assert main([str(requests), str(steps), "--out", str(tmp_path / "ctx.json")]) == 0
    text = json.loads((tmp_path / "ctx.json").read_text())["summary"]
    assert (
        text.startswith("step_context: 1 reused requests") and "; 1 load(s) a step: 1 req" in text
    )
