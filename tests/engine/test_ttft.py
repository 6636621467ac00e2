"""The per-request TTFT breakdown: its phases add up to the TTFT, chunked prefills count their
steps, the breakdown crosses the core process, lands in the request log (still readable by
``kvtier analyze``) and in the ``kvtier_request_ttft_phase_seconds{phase}`` histogram."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from cachestore.analyze.traces import read_request_log
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.client import CoreProcConfig, EngineCoreClient
from engine.core.messages import (
    AddRequest,
    CoreOutput,
    StepOutputs,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
)
from engine.sampling_params import SamplingParams
from engine.ttft import (
    ALL_PHASES,
    API_PHASES,
    ENGINE_PHASES,
    SCHEDULE_PARTS,
    STEP_PARTS,
    STEP_SUB_PARTS,
    SUB_PHASES,
    LoadTiming,
    RequestTimes,
)
from tests.engine.hf_models import make_tiny_model
from tests.engine.test_server import _metric, run_server

pytestmark = pytest.mark.timeout(120)
_ADDITIVE = [p for p in ENGINE_PHASES if p not in SUB_PHASES]


def test_breakdown_of_a_timeline_adds_up() -> None:
    t = RequestTimes(
        added=10.002,
        admitted=10.010,
        ready=10.030,
        hash_s=0.001,
        lookup_s=0.002,
        decide_s=0.0005,
        api={"api_template": 0.0001},
    )
    t.on_step(10.031, 10.041)  # two chunks, a gap between them
    t.on_step(10.045, 10.055)
    b = t.breakdown(arrival=10.0, first_token=10.056)
    assert b["to_core"] == pytest.approx(0.002)
    assert b["schedule"] == pytest.approx(0.0035)
    assert b["queue"] == pytest.approx(0.008 - 0.0035)
    assert b["load"] == pytest.approx(0.020)
    assert b["prefill_compute"] == pytest.approx(0.020)
    assert b["prefill_wait"] == pytest.approx(0.025 - 0.020)
    assert b["first_sample"] == pytest.approx(0.001)
    assert b["api_template"] == 0.0001 and b["api_tokenize"] == 0.0
    assert sum(b[p] for p in _ADDITIVE) == pytest.approx(0.056)
    assert t.num_prefill_steps == 2
    # No stamps at all (a bare scheduler): all of it is waiting to compute.
    bare = RequestTimes().breakdown(arrival=1.0, first_token=1.5)
    assert bare["prefill_wait"] == 0.5 and sum(bare.values()) == 0.5


def test_an_in_step_load_moves_from_compute_to_load() -> None:
    t = RequestTimes(added=1.0, admitted=1.01, ready=1.01)
    t.on_step(1.02, 1.07)  # 50 ms step, 12 ms of it copying the prefix in before the forward
    t.on_load(LoadTiming("r", 0.012, in_step=True))
    b = t.breakdown(arrival=1.0, first_token=1.08)
    assert b["load"] == pytest.approx(0.012) and b["load_copy"] == pytest.approx(0.012)
    assert b["prefill_compute"] == pytest.approx(0.038)
    assert sum(b[p] for p in _ADDITIVE) == pytest.approx(0.08)
    # An asynchronous load: its copies are inside the wait, nothing moves.
    a = RequestTimes(added=1.0, admitted=1.0, ready=1.03)
    a.on_step(1.03, 1.05)
    a.on_load(LoadTiming("r", 0.004))
    b = a.breakdown(arrival=1.0, first_token=1.05)
    assert b["load"] == pytest.approx(0.03) and b["load_copy"] == pytest.approx(0.004)
    assert b["prefill_compute"] == pytest.approx(0.02)
    assert sum(b[p] for p in _ADDITIVE) == pytest.approx(0.05)


def test_api_times_and_breakdown_cross_the_wire() -> None:
    add = AddRequest("r", [1, 2], SamplingParams(), 3.5, {"api_template": 0.25})
    assert decode_request(encode_request(add)) == add
    out = CoreOutput("r", [7], False, None, None, 0, 1.0, 1.0, None, {"queue": 0.5})
    assert decode_event(encode_event(StepOutputs([out], {}))).outputs == [out]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("ttft"), "llama", seed=3)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_engine_logs_a_breakdown_that_adds_up_to_ttft(model_dir: str, tmp_path: Path) -> None:
    from engine.llm import LLM

    log = tmp_path / "requests.jsonl"
    llm = LLM(
        model_dir,
        device="cpu",
        num_gpu_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=32,
        request_log=str(log),
    )
    prompts = [list(range(3, 3 + 100)), list(range(5, 5 + 20))]
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    llm.engine.close()
    rows = {r["prompt_tokens"]: r for r in _log(log)}
    for row in rows.values():
        b = row["ttft_breakdown_s"]
        assert set(b) == set(API_PHASES) | set(ENGINE_PHASES)
        assert sum(b[p] for p in _ADDITIVE) == pytest.approx(row["ttft_s"], abs=1e-5)
        assert b["schedule"] == pytest.approx(sum(b[p] for p in SCHEDULE_PARTS), abs=1e-6)
        assert b["prefill_compute"] > 0 and b["hash"] > 0
    # A 32-token budget: the 100-token prompt takes 4 steps; the 20-token one, waiting behind
    # it, gets the reserve (8 tokens) in step 2 and the rest in step 3.
    assert rows[100]["num_prefill_steps"] == math.ceil(100 / 32)
    assert rows[20]["num_prefill_steps"] == 2
    # Its two steps were shared with the long prompt's chunks: 32 tokens each.
    assert rows[20]["prefill_step_tokens"] == 2 * 32
    assert rows[100]["kv_plan"] is None  # no connector, no plan
    # Where its steps' time went in the runner: every part, adding up to a little under the
    # engine's stamp of those steps (its compute: no in-step load moved out of it here).
    for row in rows.values():
        parts = dict(row["prefill_step_parts_s"])
        cpu = parts.pop("forward_cpu")  # the thread's CPU time inside ``forward``: not summed
        others = parts.pop("others_cpu")  # other Python threads' meanwhile: not summed either
        subs = {k: parts.pop(k) for k in STEP_SUB_PARTS}  # inside ``inputs``/``hook``: not summed
        assert subs["inputs_upload"] + subs["inputs_plan"] <= parts["inputs"] + 1e-6
        assert set(parts) == set(STEP_PARTS) and parts["forward"] > 0
        assert 0 < cpu <= parts["forward"] + 2e-3  # one thread: no more CPU than wall time
        assert others >= 0.0
        compute = row["ttft_breakdown_s"]["prefill_compute"]
        assert 0.9 * compute <= sum(parts.values()) <= compute + 1e-6
    assert read_request_log(log, 16).num_requests == 2  # kvtier analyze still reads it


@pytest.mark.parametrize("in_step", [True, False])
def test_a_host_reload_shows_its_load_and_the_phases_add_up(
    model_dir: str, tmp_path: Path, in_step: bool
) -> None:
    """A prefix reloaded from a real host tier through ``LLM``: the worker's measured copy
    time reaches the log as ``load_copy`` and ``load`` holds it (an in-step load's copy is taken
    out of ``prefill_compute``); the additive phases sum to the engine-side TTFT (within 5%,
    exactly by construction) and the greedy tokens are those without offload."""
    from engine.llm import LLM

    log = tmp_path / "requests.jsonl"
    offload = {
        "decision": "load",
        "calibrate": False,
        "in_step_host_loads": in_step,
        "tiers": [{"kind": "host", "capacity": "32MiB"}],
    }
    prefix, other = list(range(3, 3 + 160)), list(range(200, 200 + 160))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    plain = LLM(model_dir, device="cpu", num_gpu_blocks=16, max_model_len=256)
    want = plain.generate([prefix + [7]], greedy)[0].token_ids
    plain.engine.close()
    llm = LLM(
        model_dir,
        device="cpu",
        num_gpu_blocks=16,
        max_model_len=256,
        request_log=str(log),
        kv_offload=True,
        kv_offload_config=offload,
    )
    try:
        llm.generate([prefix + [5]], greedy)
        llm.generate([other], greedy)  # 16 blocks: evicts the prefix to the host tier
        assert llm.generate([prefix + [7]], greedy)[0].token_ids == want
    finally:
        llm.engine.close()
    row = _log(log)[-1]
    assert row["hit_tiers"].count("host") >= 4
    b = row["ttft_breakdown_s"]
    assert sum(b[p] for p in _ADDITIVE) == pytest.approx(row["ttft_s"], rel=0.05)
    assert b["load_copy"] > 0 and b["load"] >= b["load_copy"] * (1 - 1e-6)
    if in_step:  # no wait: all of ``load`` is the copy, carved out of the step
        assert b["load"] == pytest.approx(b["load_copy"], rel=1e-3, abs=1e-6)
        assert b["prefill_compute"] > 0


def test_breakdown_reaches_the_log_and_metrics_through_the_core(
    model_dir: str, tmp_path: Path
) -> None:
    log = tmp_path / "core.jsonl"
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_model_len=256),
        request_log=str(log),
    )
    engine = EngineCoreClient.start(config, CoreProcConfig(num_threads=1))
    try:
        with run_server(engine, "m") as base:
            before = httpx.get(f"{base}/metrics").text
            body = {
                "model": "m",
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "messages": [{"role": "user", "content": "where does a block go"}],
            }
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                assert any(line == "data: [DONE]" for line in resp.iter_lines())
            after = httpx.get(f"{base}/metrics").text
    finally:
        engine.shutdown()
    for phase in ALL_PHASES:
        labels = f'{{model_name="m",phase="{phase}"}}'
        name = "kvtier_request_ttft_phase_seconds_count"
        assert _metric(after, name, labels) == _metric(before, name, labels) + 1, phase
    assert "# TYPE kvtier_request_ttft_phase_seconds histogram" in after
    (row,) = _log(log)
    b = row["ttft_breakdown_s"]
    assert b["api_template"] > 0 and b["api_tokenize"] > 0  # measured in the API process
    assert b["to_core"] > 0  # the request crossed a process
    assert sum(b[p] for p in _ADDITIVE) == pytest.approx(row["ttft_s"], abs=1e-5)
