"""bench/offload/main.py's multi-round QA section on a tiny random Llama (CPU): the event-driven
driver (admission order, sequential rounds per user, bounded concurrency, prompt composition)
and the section's figures (offload off never reuses an evicted history; offload on reloads it
whole, and the per-request loaded tokens add up to the connector's counter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.offload.parts import Setup, make_llm
from bench.offload.qa import bench_qa, qa_order, qa_sizes, run_qa
from engine.sampling_params import SamplingParams

QA = {
    "users": 6,
    "rounds": 3,
    "concurrency": 2,
    "system": 32,
    "context": 160,
    "question": 16,
    "answer": 4,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.engine.hf_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


def _setup(model_dir: str, workdir: Path, **qa: int) -> Setup:
    # decision "load": which prefixes reload must not hang on the cost model's timings of a
    # shared CI machine (the cost model's choices have tests of their own)
    return Setup(
        model_dir,
        torch.device("cpu"),
        str(workdir),
        (256,),
        16,
        {**QA, **qa},
        (),
        2048,
        60.0,
        dtype="float32",
        qa_decision="load",
    )


def test_qa_order_is_round_robin_by_round() -> None:
    assert qa_order(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_run_qa_rounds_are_sequential_per_user(model_dir: str, tmp_path: Path) -> None:
    # More slots than users: a user's next round waits for its answer, so only 2 fly at once.
    setup = _setup(model_dir, tmp_path)
    log = str(tmp_path / "log.jsonl")
    llm = make_llm(setup, 64, None, request_log=log)
    added: list[tuple[str, list[int]]] = []
    real_add = llm.engine.add_request

    def add(rid: str, prompt: list[int], params: SamplingParams) -> None:
        added.append((rid, list(prompt)))
        real_add(rid, prompt, params)

    llm.engine.add_request = add  # type: ignore[method-assign]
    history = [[10 + u] * 40 for u in range(2)]
    questions = [[[100 + 10 * r + u] * 8 for u in range(2)] for r in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        run = run_qa(llm, history, questions, params, 3, log, 60.0)
    finally:
        llm.close()
    assert [rid.split("-")[1:3] for rid, _ in added] == [
        [str(u), str(r)] for u, r in qa_order(2, 3)
    ]
    assert run.max_in_flight == 2 and run.generated_tokens == 18 and run.preemptions == 0
    assert history == [[10] * 40, [11] * 40]  # inputs untouched
    by_key = {(t.user, t.round): t for t in run.turns}
    prompts = {(int(rid.split("-")[1]), int(rid.split("-")[2])): p for rid, p in added}
    for u in range(2):
        assert prompts[(u, 0)] == history[u] + questions[0][u]
        for r in (1, 2):
            prev = prompts[(u, r - 1)]
            # history + earlier questions and answers (3 tokens each) + this round's question
            assert len(prompts[(u, r)]) == len(prev) + 3 + 8
            assert prompts[(u, r)][: len(prev)] == prev
            assert prompts[(u, r)][-8:] == questions[r][u]
            assert by_key[(u, r)].prompt_tokens == len(prompts[(u, r)])
        finished = [t.round for t in run.turns if t.user == u]
        assert finished == [0, 1, 2]


def test_bench_qa_offload_reloads_what_the_pool_evicted(model_dir: str, tmp_path: Path) -> None:
    setup = _setup(model_dir, tmp_path)
    res = bench_qa(setup)
    sizes = qa_sizes(setup)
    assert res["params"]["num_gpu_blocks"] == sizes["num_gpu_blocks"]
    # The pool holds concurrency + 1 = 3 longest histories (252 tokens: 16 blocks + 1), not 6.
    assert sizes["max_prompt_tokens"] == 32 + 160 + 2 * 20 + 16
    assert sizes["num_gpu_blocks"] == 3 * 17 + 4
    assert sizes["all_history_blocks"] == 2 + 6 * (-(-(160 + 3 * 20) // 16) + 2)
    assert not sizes["pool_holds_all_histories"]
    q, a = QA["question"], QA["answer"]
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode in ("off", "on"):
        m = res[mode]
        fields = m["per_request_fields"]
        rows[mode] = [dict(zip(fields, row, strict=True)) for row in m["per_request"]]
        assert m["requests"] == 18 and m["generated_tokens"] == 18 * a
        assert m["max_in_flight"] == 2 and m["preemptions"] == 0
        assert m["ttft_p50_s"] > 0 and m["output_tokens_per_s"] > 0
        for row in rows[mode]:
            assert row["prompt_tokens"] == 32 + 160 + row["round"] * (q + a) + q
    for row in rows["off"]:
        assert row["loaded_tokens"] == 0 and row["decision"] == "recompute"
        if row["round"] > 0:  # the history was evicted from the pool before this round
            assert row["cached_tokens"] < (row["prompt_tokens"] - q) // 16 * 16
    on = res["on"]
    for row in rows["on"]:
        if row["round"] > 0:  # the whole history is back: GPU leftovers plus a reload
            assert row["cached_tokens"] == (row["prompt_tokens"] - q) // 16 * 16
            assert row["loaded_tokens"] > 0
    assert on["loaded_tokens"] == on["kv_loaded_tokens"] > 0
    assert sum(on["decisions"].values()) >= 12
    assert res["ttft_p50_ratio"] == res["off"]["ttft_p50_s"] / on["ttft_p50_s"]
    assert res["throughput_ratio"] == (
        on["output_tokens_per_s"] / res["off"]["output_tokens_per_s"]
    )
