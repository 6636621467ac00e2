"""``--step-log``: one JSON line per engine step, read back against what the engine was asked.
The tiny random llama on CPU; prompts long enough to be chunked; with the offload connector, a
prompt evicted to the host tier and sent again shows its load in the step that computed it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.ttft import STEP_CPU_PARTS, STEP_PARTS, STEP_SUB_PARTS
from tests.connectors.offload.test_connector import make_llm
from tests.engine.hf_models import make_tiny_model

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("step_log"), "llama", seed=7)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_step_is_a_line_with_its_chunks_decodes_and_parts(
    model_dir: str, tmp_path: Path
) -> None:
    log = tmp_path / "steps.jsonl"
    llm = make_llm(model_dir, 64, step_log=str(log), max_num_batched_tokens=64)
    prompts = [list(range(10, 160)), list(range(160, 200)), list(range(200, 290))]  # disjoint
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    llm.close()
    lines = _lines(log)
    assert lines and all(0 < line["tokens"] <= 64 and line["ms"] > 0 for line in lines)
    chunks: dict[str, list[list]] = {}
    for line in lines:
        assert line["tokens"] == line["decodes"] + sum(c[1] for c in line["prefill"]), line
        parts = line["parts"]
        assert set(parts) == {*STEP_PARTS, *STEP_CPU_PARTS, *STEP_SUB_PARTS}, parts
        # the sub-parts of ``inputs`` lie inside it; one thread spends no more CPU than wall time
        # (ms, rounded to 3 decimals in the log, hence the slack)
        assert parts["inputs_upload"] + parts["inputs_plan"] <= parts["inputs"] + 0.01, parts
        assert 0 < parts["inputs_upload"] and 0 <= parts["inputs_cpu"] <= parts["inputs"] + 2
        assert 0 <= parts["hook_cpu"] <= parts["hook"] + 2, parts
        assert line["loads"] == [] and line["waiting"] >= 0 and line["running"] >= 1
        for chunk in line["prefill"]:
            chunks.setdefault(chunk[0], []).append(chunk)
    # Each prompt computed once, in order, in chunks of at most 64 tokens, sampling at the last.
    by_len = {}
    for req_chunks in chunks.values():
        offset = 0
        for _, n, computed, sample in req_chunks:
            assert computed == offset and n <= 64
            offset += n
            assert sample == (offset == sum(c[1] for c in req_chunks))
        by_len[offset] = req_chunks
    assert sorted(by_len) == sorted(len(p) for p in prompts)
    assert [len(o.token_ids) for o in outs] == [MAX_TOKENS] * 3
    # the first token comes from the prefill; every other one is a decode of some step
    assert sum(line["decodes"] for line in lines) == 3 * (MAX_TOKENS - 1)
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)


def test_a_reloaded_prompt_s_load_is_in_its_step(model_dir: str, tmp_path: Path) -> None:
    """A 24-block pool and five 100-token prompts evict the first prompt's 6 full blocks to the
    host tier; sent again, they load back: the step that computes the rest of that prompt
    lists the load (request id, copy time) and a chunk that starts after the loaded tokens."""
    log = tmp_path / "steps.jsonl"
    offload = {"decision": "load", "tiers": [{"kind": "host", "capacity": "8MiB"}]}
    llm = make_llm(model_dir, 24, offload, step_log=str(log))
    prompts = [[1, *range(10 + 90 * i, 109 + 90 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params)
    before = len(_lines(log)) if log.exists() else 0
    llm.generate([prompts[0]], params)
    llm.close()
    again = _lines(log)[before:]
    loads = [load for line in again for load in line["loads"]]
    assert len(loads) == 1 and loads[0][1] >= 0, loads
    (step,) = [line for line in again if line["loads"]]
    ((req_id, n, computed, sample),) = step["prefill"]
    assert req_id == loads[0][0] and computed == 6 * 16 and n == 100 - 96 and sample


def test_a_collection_during_a_step_is_in_its_line_and_one_before_it_is_not(
    tmp_path: Path,
) -> None:
    import gc
    import time

    from engine.core_types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
    from engine.step_log import StepLog

    log = StepLog(tmp_path / "steps.jsonl")
    out = SchedulerOutput(
        [ScheduledRequest("r", [1, 2, 3], 0, [0], True, SamplingParams(temperature=0.0))], 3
    )
    runner_out = ModelRunnerOutput(sampled_token_ids={}, logits=None)
    gc.collect()  # before the first step: in no line
    start = time.time()
    garbage = [[i] for i in range(200_000)]  # something for the collection to walk
    gc.collect()
    del garbage
    log.write(start, 0.01, out, runner_out, 0, 1)
    log.write(time.time(), 0.01, out, runner_out, 0, 1)  # nothing collected during it
    log.close()
    lines = _lines(tmp_path / "steps.jsonl")
    assert lines[0]["gc"][1] == 2 and lines[0]["gc"][0] > 0
    assert "gc" not in lines[1]
    assert log._gc._callback not in gc.callbacks  # closed: the callback is gone
